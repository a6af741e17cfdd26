"""Fused dequant-GEMM Triton kernels (one source for CUDA and ROCm).

``wq_gemm``: weight-only quantized linear (w4a16 / w8a16, 2- and 3-bit too), GEMV split-K,
small-M and tiled paths. ``w8a8``: int8 per-token activations x int8 per-channel weights.
``configs``: autotune lists per target (CUDA sm80/sm90, ROCm CDNA3) and the fixed
interpreter config. Nothing here runs at import: kernels are compiled on first launch and
autotuned kernels are built on first use.
"""
