"""The neutral types below every other layer: the quantization scheme and the canonical unpacked
result (``scheme.py``), the FP8 / FP4 element codes (``floatcodes.py``) and the KV-cache setting
(``kv_config.py``). ``quant/`` (the algorithms), ``formats/`` and ``kernels/`` all read them;
nothing here imports from those packages.
"""
