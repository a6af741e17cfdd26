"""Typed, validated settings of a recipe's parts: calibration data and each method's options.
A leaf module (the methods and the recipe both read it). Unknown keys are errors."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import QuantspecError
from .hessian import HESSIAN_DTYPES
from .precision import FORWARD_DTYPES


@dataclass(frozen=True)
class CalibrationConfig:
    """Calibration data: a data name (c4, wikitext2, c4-bundled: the C4 sample shipped in the
    package, pydoc) or a .txt/.jsonl path. Offline without a local copy, c4 and wikitext2 fall
    back to c4-bundled (``data.fallback``)."""

    data: str = "c4"
    samples: int | None = None  # None: 128 on a GPU, 64 on a CPU
    seqlen: int | None = None  # None: 2048 on a GPU, 512 on a CPU
    seed: int = 0
    # mixture-of-experts models: "all" sends every calibration token through every routed
    # expert for its statistics while the block's output stays the routed one (no expert goes
    # uncalibrated); "routed": each expert sees only the tokens routed to it (an expert with
    # fewer than gptq.min_rows gets round-to-nearest, reported). models/experts.py
    experts: str = "all"

    def __post_init__(self) -> None:
        if self.experts not in ("all", "routed"):
            raise QuantspecError(f"calibration experts={self.experts!r} is not all or routed.",
                                 "use all (the default: every expert sees every token) or routed.")
        for name in ("samples", "seqlen"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise QuantspecError(
                    f"calibration {name}={v!r} must be a positive integer.",
                    f"set calibration.{name} to e.g. 128 (samples) or 2048 (seqlen).",
                )

    def resolved(self, on_gpu: bool) -> "CalibrationConfig":
        return replace(
            self,
            samples=self.samples or (128 if on_gpu else 64),
            seqlen=self.seqlen or (2048 if on_gpu else 512),
        )


@dataclass(frozen=True)
class GPTQOptions:
    """GPTQ settings. ``single_pass_gb``: when a block's activations for the whole calibration
    set fit in this many GiB, each block runs once on all samples as one batch and every Linear
    is quantized inside that forward, just before it is used (true-sequential at no extra
    cost: about 2.5x faster on the CPU); above it (or when the block does not batch) the block
    is re-run per Linear group, one sample at a time, and the peak memory stays at about one
    sample's activations. ``None`` (the default): half the memory free on the blocks' device
    when the first block starts (``block_methods.single_pass_limit``; the same limit for every
    block of the run); 0 forces the per-group path.
    SmolLM2-135M at 64 x 512 needs ~0.9 GiB, Qwen2.5-0.5B ~2.4 GiB."""

    damp_percent: float = 0.01
    block_size: int = 128
    single_pass_gb: float | None = None
    # a Linear whose Hessian comes from fewer calibration rows than this (a MoE expert the
    # router sent no token, under calibration experts=routed) is rounded to nearest instead,
    # and the report says so: GPTQ has nothing to compensate with
    min_rows: int = 1
    # the dtype of the Hessian's products (the sums are fp32 either way; hessian.py):
    # "bfloat16" rounds the inputs to bf16 (2.3x faster on a CPU with native bf16 dot products),
    # "auto" takes it there (block_methods.hessian_bf16) and "float32" everywhere else
    hessian_dtype: str = "auto"
    # the precision of the single pass's block forwards over an fp32 model (the quantized one,
    # and asymmetric calibration's float one): "bfloat16" runs their matrix products under bf16
    # autocast (weights, Hessians, the GPTQ solve and the stream between blocks stay fp32;
    # a block forward is ~2x faster on a CPU with native bf16), "auto" where the device
    # multiplies bf16 natively (precision.native_bf16). The per-group path runs fp32.
    # float32 is the default: bf16 forwards cost 0.4-0.7% validation perplexity on SmolLM2-135M
    # FP4 (docs/decisions/gptq-forward-dtype.md)
    forward_dtype: str = "float32"
    # asymmetric calibration (GPTAQ's objective, gptq.asymmetric_target): each Linear's rounding
    # aims at the float model's output on the float model's inputs, ||W X - Q Xq||, instead of
    # its own weight on the quantized model's inputs, ||(W - Q) Xq||, so a layer also corrects
    # the error the quantized layers before it left in its input. Costs one more float forward
    # of each block and one more K x K product per Linear input (in hessian_dtype); the single
    # pass only, whose memory limit (single_pass_gb) then counts the float stream too. true
    # refuses what it cannot run (torchrun, a block beyond the limit); "auto" runs it where it
    # can and plain GPTQ elsewhere, saying why in the report (block_methods.GPTQMethod)
    asymmetric: bool | str = False
    # the share of the asymmetric correction applied (W + alpha * W C Hd^-1): the full one
    # (1) overshoots where the quantized inputs have little variance (GPTAQ's code uses 0.25)
    asymmetric_alpha: float = 0.25
    # a layer whose corrected weight would move by more than this share of its norm keeps GPTQ's
    # own target (reported): there the quantized inputs lack variance the float ones have, and
    # the correction blows up instead of compensating
    asymmetric_max_shift: float = 0.5

    def __post_init__(self) -> None:
        if not (isinstance(self.asymmetric_alpha, (int, float)) and 0 < self.asymmetric_alpha <= 1):
            raise QuantspecError(f"gptq.asymmetric_alpha={self.asymmetric_alpha!r} is not in (0, 1].",
                                 "use e.g. 0.25.")
        if not (isinstance(self.asymmetric_max_shift, (int, float)) and self.asymmetric_max_shift > 0):
            raise QuantspecError(f"gptq.asymmetric_max_shift={self.asymmetric_max_shift!r} is not a positive number.",
                                 "use e.g. 0.5.")
        if not (isinstance(self.asymmetric, bool) or self.asymmetric == "auto"):
            raise QuantspecError(f"gptq.asymmetric={self.asymmetric!r} is not true, false or auto.",
                                 "use true (asymmetric calibration), false (GPTQ's own objective) or auto "
                                 "(asymmetric where it can run).")
        if self.hessian_dtype not in HESSIAN_DTYPES:
            raise QuantspecError(f"gptq.hessian_dtype={self.hessian_dtype!r} is not one of {', '.join(HESSIAN_DTYPES)}.",
                                 "use auto, float32 or bfloat16.")
        if self.forward_dtype not in FORWARD_DTYPES:
            raise QuantspecError(f"gptq.forward_dtype={self.forward_dtype!r} is not one of {', '.join(FORWARD_DTYPES)}.",
                                 "use float32, bfloat16 or auto.")
        if self.single_pass_gb is not None and not (
            isinstance(self.single_pass_gb, (int, float)) and not isinstance(self.single_pass_gb, bool)
            and self.single_pass_gb >= 0
        ):
            raise QuantspecError(
                f"gptq.single_pass_gb={self.single_pass_gb!r} must be a number >= 0 (or null: half the free memory).",
                "use e.g. 8, or leave it out.",
            )
        if not 0 < self.damp_percent < 1:
            raise QuantspecError(
                f"gptq.damp_percent={self.damp_percent} must lie in (0, 1).", "use e.g. 0.01."
            )
        if self.block_size < 1:
            raise QuantspecError("gptq.block_size must be positive.", "use e.g. 128.")
        if not isinstance(self.min_rows, int) or self.min_rows < 1:
            raise QuantspecError(f"gptq.min_rows={self.min_rows!r} must be a positive integer.", "use e.g. 1.")


@dataclass(frozen=True)
class AWQOptions:
    grid: int = 20
    # weight-clipping search: True, False, or None = by bit width (awq.clip_wanted)
    clip: bool | None = None
    # candidate scales: False the paper's x^a, True AutoAWQ's "duo" x^a / w^(1-a), "both" the union
    duo_scaling: bool | str = "both"
    save_scales: str | None = None
    load_scales: str | None = None
    # precision of the searches' forward passes over an fp32 model: float32 (exact, the
    # default), bfloat16 (matrix products under bf16 autocast; the fake-quantized weights and the
    # errors stay fp32), or auto (bfloat16 where the device multiplies bf16 natively: CPUs with
    # AVX-512 BF16 or AMX, CUDA GPUs with bf16). About half the search time on a 2-core AMX Xeon.
    search_dtype: str = "float32"
    # a group's clip is kept only where it lowers the group's output error on the clip sample
    # by more than this fraction (0: any improvement, as the AWQ paper); why 0.3:
    # docs/decisions/awq-defaults.md
    clip_min_gain: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_min_gain < 1.0:
            raise QuantspecError(f"awq.clip_min_gain={self.clip_min_gain} is not in [0, 1).",
                                 "use e.g. 0.3 (the default) or 0 to keep every clip that helps at all.")
        if self.search_dtype not in FORWARD_DTYPES:
            raise QuantspecError(f"awq.search_dtype={self.search_dtype!r} is not float32, bfloat16 or auto.",
                                 "use float32 (the default), bfloat16 or auto.")
        if self.duo_scaling not in (True, False, "both"):
            raise QuantspecError(
                f"awq.duo_scaling={self.duo_scaling!r} is not one of true, false, both.",
                "use both (the default), true or false.",
            )
        if self.grid < 2:
            raise QuantspecError(f"awq.grid={self.grid} must be at least 2.", "use e.g. 20.")


@dataclass(frozen=True)
class SmoothQuantOptions:
    alpha: float = 0.5

    def __post_init__(self) -> None:
        if not 0 <= self.alpha <= 1:
            raise QuantspecError(
                f"smoothquant.alpha={self.alpha} must lie in [0, 1].", "use e.g. 0.5."
            )
