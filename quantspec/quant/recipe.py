"""Recipes: what to quantize, how, and into which format. YAML maps 1:1 onto ``Recipe``.

Example (recipes/gptq-w4g128.yaml)::

    name: gptq-w4g128
    method: gptq
    format: gptq
    scheme: {bits: 4, group_size: 128, symmetric: true, act_order: false}
    ignore: [lm_head]
    calibration: {data: c4, samples: 128, seqlen: 2048, seed: 0}
    gptq: {damp_percent: 0.01, block_size: 128}

Unknown keys are errors (a typo must not silently fall back to a default), and so are values of
the wrong type (``strict.check_types``: ``symmetric: "no"`` is not a bool). Without a
``name`` the recipe is named after its method and scheme (``default_recipe_name``, as the CLI
names a recipe built from flags). The resolved recipe is saved as recipe.yaml in every checkpoint.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from ..errors import QuantspecError, one_line
from ..formats import FORMAT_NAMES
from ..strict import from_dict_strict, reject_unknown
from ..core.kv_config import KVCacheConfig
from .options import AWQOptions, CalibrationConfig, GPTQOptions, SmoothQuantOptions
from .registry import METHODS, default_scheme
from ..core.floatcodes import require_float8
from ..core.scheme import QuantScheme
from ..strict import check_types


@dataclass(frozen=True)
class Recipe:
    name: str | None = "gptq-w4g128"  # the default recipe's; None: default_recipe_name(method, scheme)
    method: str = "gptq"
    format: str = "gptq"
    scheme: QuantScheme | None = None  # None: default_scheme(method)
    targets: tuple[str, ...] = ()  # regexes of Linear names; empty = every Linear in the blocks
    ignore: tuple[str, ...] = ("lm_head",)
    calibration: CalibrationConfig = field(default_factory=CalibrationConfig)
    gptq: GPTQOptions = field(default_factory=GPTQOptions)
    awq: AWQOptions = field(default_factory=AWQOptions)
    smoothquant: SmoothQuantOptions = field(default_factory=SmoothQuantOptions)
    kv_cache: KVCacheConfig | None = None  # calibrated KV-cache scales (compressed-tensors only)

    def __post_init__(self) -> None:
        check_types(Recipe, _values(self), "recipe")
        for key, part in _values(self).items():
            if is_dataclass(part):
                check_types(type(part), _values(part), f"recipe.{key}")
        if self.method not in METHODS:
            raise QuantspecError(
                f"unknown method {self.method!r}.", f"use one of {list(METHODS)}."
            )
        if self.scheme is None:
            object.__setattr__(self, "scheme", default_scheme(self.method))
        if self.name is None:
            object.__setattr__(self, "name", default_recipe_name(self.method, self.scheme))
        if self.format not in FORMAT_NAMES:
            raise QuantspecError(
                f"unknown format {self.format!r}.", f"use one of {list(FORMAT_NAMES)}."
            )
        spec = METHODS[self.method]
        if spec.activations and self.scheme.activations is None:
            raise QuantspecError(
                f"{self.method} is a W8A8 method but the scheme has no activation quantization.",
                "set scheme.bits=8, group_size=-1, activations='int8-token-dynamic'.",
            )
        if self.kv_cache is not None and self.format != "compressed-tensors":
            raise QuantspecError(
                f"KV-cache scales are written in compressed-tensors' kv_cache_scheme, not the {self.format!r} format.",
                "use --format compressed-tensors with --kv-cache.",
            )
        if self.scheme.is_float:
            require_float8(f"{self.scheme.weights} weights")
        if self.kv_cache is not None and self.kv_cache.kind == "fp8":
            require_float8("an fp8 KV cache")
        if self.scheme.is_float and self.format != "compressed-tensors":
            raise QuantspecError(
                f"{self.scheme.weights} weights cannot be written in the {self.format!r} format "
                "(it holds integer codes).",
                "use --format compressed-tensors.",
            )
        if self.scheme.is_float and spec.activations:
            raise QuantspecError(
                f"{self.method} computes int8 activation scales; {self.scheme.weights} weights do not use them.",
                f"use one of {[m for m, sp in METHODS.items() if not sp.activations]} with --scheme "
                f"{self.scheme.short_name}.",
            )
        if self.scheme.is_block and self.awq.clip and "awq" in (self.method, *spec.steps):
            raise QuantspecError(
                "AWQ's clip search scores each row's group on that row's own scale, but fp8 block "
                "weights share one scale per 128 rows.",
                "drop --clip (awq.clip: false); AWQ's scale search itself runs on fp8 blocks.",
            )
        if self.scheme.activations is not None and self.format != "compressed-tensors":
            raise QuantspecError(
                f"W8A8 cannot be written in the {self.format!r} format.",
                "use --format compressed-tensors.",
            )
        if self.scheme.act_order and not spec.hessian:
            raise QuantspecError(
                f"act_order needs a Hessian: it is a GPTQ option, not a {self.method} one.",
                f"use one of {[m for m, sp in METHODS.items() if sp.hessian]} or drop --act-order.",
            )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["scheme"] = self.scheme.to_dict()
        if self.kv_cache is None:  # recipes without KV scales read as they did before the field
            del d["kv_cache"]
        d["targets"] = list(self.targets)
        d["ignore"] = list(self.ignore)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Recipe":
        data = dict(data)
        reject_unknown(cls, data, "recipe")
        data.setdefault("name", None)  # a recipe without one is named after what it holds
        nested = {
            "scheme": QuantScheme,
            "calibration": CalibrationConfig,
            "gptq": GPTQOptions,
            "awq": AWQOptions,
            "smoothquant": SmoothQuantOptions,
            "kv_cache": KVCacheConfig,
        }
        for key, sub in nested.items():
            if key in data and data[key] is not None and not isinstance(data[key], sub):
                if not isinstance(data[key], dict):
                    raise QuantspecError(
                        f"recipe field {key!r} must be a mapping.", f"write {key}: {{...}}."
                    )
                check_types(sub, data[key], f"recipe.{key}")  # before its own checks compare values
                data[key] = from_dict_strict(sub, data[key], f"recipe.{key}")
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
            raise QuantspecError(f"recipe {p} is not valid YAML: {one_line(exc)}.", "fix the YAML.") from exc
        if not isinstance(data, dict):
            raise QuantspecError(f"recipe {p} must be a YAML mapping.", "see recipes/*.yaml.")
        return cls.from_dict(data)


def _values(obj: Any) -> dict[str, Any]:
    """The fields of dataclass instance ``obj`` by name (not recursing, unlike ``asdict``)."""
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


def default_recipe_name(method: str, scheme: QuantScheme) -> str:
    return f"{method.replace('+', '-')}-{scheme.short_name}"
