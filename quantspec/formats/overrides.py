"""Per-layer scheme overrides in a quantization_config (layers regrouped by the plan).

GPTQ: GPTQModel's ``dynamic`` map, positive entries ``"+:<regex>": {bits, group_size, desc_act,
sym}``, read by GPTQModel and vLLM (``re.match`` against the module name). vLLM fuses q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj``, so a regex naming one projection also names its
fused module. compressed-tensors: one extra config group per override scheme whose targets are
``re:<regex>`` (a regex target outranks the class target ``Linear``). AWQ has no per-layer
mechanism: the plan leaves such layers dense instead.
"""

from __future__ import annotations

import re
from copy import deepcopy

from ..errors import QuantspecError
from ..core.scheme import QuantScheme
from .gptq import scheme_from_config

SUPPORTS_OVERRIDES = ("gptq", "compressed-tensors")
# projection -> the fused module vLLM builds from it
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
         "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _with_fused(pattern: str) -> str:
    for part, fused in FUSED.items():
        if pattern.endswith(re.escape(part)):
            stem = pattern[: -len(re.escape(part))]
            return f"{stem}(?:{re.escape(part)}|{re.escape(fused)})"
    return pattern


def _alternation(patterns: list[str]) -> str:
    return "^(?:" + "|".join(_with_fused(p) for p in patterns) + ")$"


def with_overrides(fmt_name: str, cfg: dict, overrides: list[tuple[list[str], QuantScheme]]) -> dict:
    """Return ``cfg`` with each (regexes, scheme) override recorded the format's way."""
    cfg = deepcopy(cfg)
    if fmt_name == "gptq":
        dynamic = cfg.setdefault("dynamic", {})
        for patterns, s in overrides:
            # as the base config (gptq.py): static groups keep the natural layout, written
            # desc_act=false (vLLM refuses desc_act=true, also inside a dynamic rule)
            dynamic["+:" + _alternation(patterns)] = {
                "bits": s.bits, "group_size": s.group_size, "desc_act": s.act_order and not s.static_groups,
                "sym": s.symmetric,
            }
        return cfg
    if fmt_name == "compressed-tensors":
        from .compressed_tensors import CompressedTensorsFormat

        groups = cfg["config_groups"]
        for i, (patterns, s) in enumerate(overrides, start=len(groups)):
            group = deepcopy(CompressedTensorsFormat().quantization_config(s, [])["config_groups"]["group_0"])
            group["targets"] = ["re:" + _alternation(patterns)]
            groups[f"group_{i}"] = group
        return cfg
    raise QuantspecError(
        f"the {fmt_name} format cannot record per-layer schemes.",
        "use --format gptq or compressed-tensors, or a group size that divides every layer's K.",
    )


def split_overrides(qcfg: dict) -> tuple[dict, list[tuple[str, QuantScheme]]]:
    """Separate per-layer overrides from a quantization_config: (base config, [(regex, scheme)])."""
    method = str(qcfg.get("quant_method", "")).lower().replace("_", "-")
    base = deepcopy(qcfg)
    out: list[tuple[str, QuantScheme]] = []
    if method == "gptq" and isinstance(qcfg.get("dynamic"), dict):
        dynamic = {}
        for key, val in qcfg["dynamic"].items():
            if key.startswith("-:"):
                dynamic[key] = val
                continue
            pattern = key[2:] if key.startswith("+:") else key
            if not isinstance(val, dict):
                raise QuantspecError(f"GPTQ dynamic entry {key!r} is {val!r}, not a mapping.",
                                     "write each dynamic entry as {bits: ..., group_size: ...} in config.json.")
            # the entry's fields over the base config's (static groups: the base config's)
            merged = {"bits": 4, **qcfg, **val, "static_groups": qcfg.get("static_groups")}
            out.append((pattern, scheme_from_config(merged, f"GPTQ dynamic entry {key!r}")))
        base["dynamic"] = dynamic
    elif method == "compressed-tensors" and len(qcfg.get("config_groups") or {}) > 1:
        from .compressed_tensors import CompressedTensorsFormat

        groups = qcfg["config_groups"]
        main = [k for k, g in groups.items() if "Linear" in (g.get("targets") or [])]
        if len(main) != 1:
            raise QuantspecError(
                "compressed-tensors config has several groups and none (or several) targets 'Linear'.",
                "requantize with one base scheme for all Linear layers.",
            )
        base["config_groups"] = {main[0]: groups[main[0]]}
        for key, g in groups.items():
            if key == main[0]:
                continue
            one = deepcopy(base)
            one["config_groups"] = {key: {**g, "targets": ["Linear"]}}
            scheme = CompressedTensorsFormat().parse_config(one).scheme
            for t in g.get("targets") or []:
                if not t.startswith("re:"):
                    t = "^" + re.escape(t) + "$"
                else:
                    t = t[3:]
                out.append((t, scheme))
    return base, out


def read_with_overrides(qcfg: dict):
    """``read_quantization_config`` that also understands per-layer overrides."""
    from . import read_quantization_config

    base, overrides = split_overrides(qcfg)
    fmt, fcfg = read_quantization_config(base)
    fcfg.overrides = overrides
    return fmt, fcfg
