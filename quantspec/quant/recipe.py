"""Recipes: what to quantize, how, and into which format. YAML maps 1:1 onto ``Recipe``.

Example (recipes/gptq-w4g128.yaml)::

    name: gptq-w4g128
    method: gptq
    format: gptq
    scheme: {bits: 4, group_size: 128, symmetric: true, act_order: false}
    ignore: [lm_head]
    calibration: {data: c4, samples: 128, seqlen: 2048, seed: 0}
    gptq: {damp_percent: 0.01, block_size: 128}

Unknown keys are errors (a typo must not silently fall back to a default). The resolved recipe
is saved as recipe.yaml in every checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..errors import QuantspecError
from .scheme import QuantScheme

METHODS = ("rtn", "gptq", "awq", "smoothquant", "awq+gptq")
FORMATS = ("gptq", "awq", "compressed-tensors")


def _strict(cls, data: dict[str, Any] | None, where: str):
    data = dict(data or {})
    known = {f.name for f in fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise QuantspecError(
            f"unknown field(s) {sorted(unknown)} in {where}.", f"use only {sorted(known)}."
        )
    return cls(**data)


@dataclass(frozen=True)
class CalibrationConfig:
    """Calibration data: a data name (wikitext2, c4, pydoc) or a .txt/.jsonl path."""

    data: str = "c4"
    samples: int | None = None  # None: 128 on a GPU, 64 on a CPU
    seqlen: int | None = None  # None: 2048 on a GPU, 512 on a CPU
    seed: int = 0

    def __post_init__(self) -> None:
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
    sample's activations. 0 forces the per-group path. SmolLM2-135M at 64 x 512 needs ~0.9 GiB,
    Qwen2.5-0.5B ~2.4 GiB."""

    damp_percent: float = 0.01
    block_size: int = 128
    single_pass_gb: float = 2.0

    def __post_init__(self) -> None:
        if not self.single_pass_gb >= 0:
            raise QuantspecError(
                f"gptq.single_pass_gb={self.single_pass_gb} must be >= 0.", "use e.g. 8."
            )
        if not 0 < self.damp_percent < 1:
            raise QuantspecError(
                f"gptq.damp_percent={self.damp_percent} must lie in (0, 1).", "use e.g. 0.01."
            )
        if self.block_size < 1:
            raise QuantspecError("gptq.block_size must be positive.", "use e.g. 128.")


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
    # AMX, CUDA GPUs with bf16). About half the search time on a 2-core AMX Xeon.
    search_dtype: str = "float32"
    # a group's clip is kept only where it lowers the group's output error on the clip sample
    # by more than this fraction (0: any improvement, as the AWQ paper). W3, whole models,
    # perplexity on wikitext2 / on C4 text outside the calibration (the same scales, clips
    # re-chosen; benchmarks/results/awq-sq-peers.md, session 16): Qwen2.5-Coder-0.5B g128
    # 79.50 / 50.14 at 0, 77.01 / 48.62 at 0.1, 69.58 / 45.96 at 0.3 (no clipping 74.34 / 52.43);
    # SmolLM2-135M g64 64.57 / 46.09, 63.94 / 45.71, 65.29 / 46.84 (no clipping 74.42 / 54.75)
    clip_min_gain: float = 0.3

    def __post_init__(self) -> None:
        if not 0.0 <= self.clip_min_gain < 1.0:
            raise QuantspecError(f"awq.clip_min_gain={self.clip_min_gain} is not in [0, 1).",
                                 "use e.g. 0.3 (the default) or 0 to keep every clip that helps at all.")
        if self.search_dtype not in ("float32", "bfloat16", "auto"):
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


# Methods that have a Hessian, so act-order applies.
HESSIAN_METHODS = ("gptq", "awq+gptq")


def default_scheme(method: str) -> QuantScheme:
    """W4 g128 symmetric; GPTQ methods add static act-order (columns by decreasing Hessian
    diagonal, groups fixed before the pass: better perplexity, no g_idx, loads everywhere);
    AWQ is asymmetric; SmoothQuant is W8A8."""
    if method == "smoothquant":
        return QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic")
    if method in HESSIAN_METHODS:
        return QuantScheme(act_order=True, static_groups=True)
    return QuantScheme(symmetric=method != "awq")


@dataclass(frozen=True)
class Recipe:
    name: str = "gptq-w4g128"
    method: str = "gptq"
    format: str = "gptq"
    scheme: QuantScheme | None = None  # None: default_scheme(method)
    targets: tuple[str, ...] = ()  # regexes of Linear names; empty = every Linear in the blocks
    ignore: tuple[str, ...] = ("lm_head",)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    awq: AWQOptions = field(default_factory=AWQOptions)
    smoothquant: SmoothQuantOptions = field(default_factory=SmoothQuantOptions)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise QuantspecError(
                f"unknown method {self.method!r}.", f"use one of {list(METHODS)}."
            )
        if self.scheme is None:
            object.__setattr__(self, "scheme", default_scheme(self.method))
        if self.format not in FORMATS:
            raise QuantspecError(
                f"unknown format {self.format!r}.", f"use one of {list(FORMATS)}."
            )
        if self.method == "smoothquant" and self.scheme.activations is None:
            raise QuantspecError(
                "smoothquant is a W8A8 method but the scheme has no activation quantization.",
                "set scheme.bits=8, group_size=-1, activations='int8-token-dynamic'.",
            )
        if self.scheme.activations is not None and self.format != "compressed-tensors":
            raise QuantspecError(
                f"W8A8 cannot be written in the {self.format!r} format.",
                "use --format compressed-tensors.",
            )
        if self.method == "rtn" and self.scheme.act_order:
            raise QuantspecError(
                "act_order needs a Hessian: it is a GPTQ option, not an RTN one.",
                "use --method gptq or drop --act-order.",
            )

    @property
    def needs_calibration(self) -> bool:
        return self.method != "rtn"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["targets"] = list(self.targets)
        d["ignore"] = list(self.ignore)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recipe":
        data = dict(data)
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise QuantspecError(
                f"unknown recipe field(s) {sorted(unknown)}.", f"use only {sorted(known)}."
            )
        nested = {
            "scheme": QuantScheme,
            "calibration": CalibrationConfig,
            "gptq": GPTQOptions,
            "awq": AWQOptions,
            "smoothquant": SmoothQuantOptions,
        }
        for key, sub in nested.items():
            if key in data and not isinstance(data[key], sub):
                if not isinstance(data[key], dict):
                    raise QuantspecError(
                        f"recipe field {key!r} must be a mapping.", f"write {key}: {{...}}."
                    )
                data[key] = _strict(sub, data[key], f"recipe.{key}")
        for key in ("targets", "ignore"):
            if key in data:
                if not isinstance(data[key], (list, tuple)):
                    raise QuantspecError(
                        f"recipe field {key!r} must be a list.", f"write {key}: [lm_head]."
                    )
                data[key] = tuple(data[key])
        return cls(**data)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "Recipe":
        import yaml

        p = Path(path)
        if not p.is_file():
            raise QuantspecError(f"recipe file {p} does not exist.", "check the path.")
        try:
            data = yaml.safe_load(p.read_text())
        except yaml.YAMLError as exc:
            raise QuantspecError(f"recipe {p} is not valid YAML: {exc}.", "fix the YAML.") from exc
        if not isinstance(data, dict):
            raise QuantspecError(f"recipe {p} must be a YAML mapping.", "see recipes/*.yaml.")
        return cls.from_dict(data)


def default_recipe_name(method: str, scheme: QuantScheme) -> str:
    return f"{method.replace('+', '-')}-{scheme.short_name}"
