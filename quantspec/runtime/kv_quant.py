"""A quantized KV cache for transformers models, and the observer that calibrates its scales.

Keys are observed and quantized after RoPE (as the attention module hands them to the cache,
which is what an engine stores). A KV setting (``KVSetting``):

* ``kind``: "fp8" (E4M3FN, max 448) or "int8" (symmetric, max 127);
* ``scales``: "calibrated" (per layer from calibration data: one scale per tensor, or one per
  KV head), "unit" (every scale 1.0, what an engine uses when a checkpoint has none), or
  "dynamic" (each cache write takes its own per-tensor scale from its amax);
* scale = amax / max code, so the largest calibrated value lands on the top code.

``QuantKVCache`` quantize-dequantizes every key and value written into it (fp32 arithmetic),
so any transformers forward that takes a cache (perplexity windows, generation) computes
attention on the values a quantized cache would hold. ``KVObserver`` records per-layer,
per-head absolute maxima, ``KVErrorObserver`` the squared error under candidate scales (the "mse"
rule of ``KVCacheConfig``). Pure tensor functions: ``fake_quant``, ``scales_from_amax``,
``scale_errors``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..errors import QuantspecError
from ..core.floatcodes import round_fp8
from ..core.kv_config import KV_MAX
from ..kernels.cpu_ext import load_cpu_ext

KV_SCALES = ("calibrated", "unit", "dynamic")


@dataclass(frozen=True)
class KVSetting:
    kind: str = "fp8"
    scales: str = "calibrated"

    def __post_init__(self) -> None:
        if self.kind not in KV_MAX:
            raise QuantspecError(f"KV cache kind {self.kind!r} is not supported.", f"use one of {list(KV_MAX)}.")
        if self.scales not in KV_SCALES:
            raise QuantspecError(f"KV cache scales {self.scales!r} are unknown.", f"use one of {list(KV_SCALES)}.")


def fake_quant(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """``x`` [B, H, T, D] rounded to the ``kind`` grid under ``scale`` (a scalar or [H]), in x's
    dtype (arithmetic in fp32)."""
    s = scale.to(device=x.device, dtype=torch.float32)
    if s.numel() > 1:
        s = s.reshape(1, -1, 1, 1)
    return (round_codes(x.to(torch.float32) / s, kind) * s).to(x.dtype)


def round_codes(y: torch.Tensor, kind: str) -> torch.Tensor:
    """``y`` (fp32, in units of its scale) rounded to the nearest ``kind`` code, saturating."""
    return round_fp8(y) if kind == "fp8" else torch.round(y).clamp(-KV_MAX[kind], KV_MAX[kind])


def scales_from_amax(amax: torch.Tensor, kind: str) -> torch.Tensor:
    """Scale(s) that map ``amax`` onto the top code (a zero amax gets scale 1)."""
    s = amax.to(torch.float32) / KV_MAX[kind]
    return torch.where(s > 0, s, torch.ones_like(s))


def scale_multipliers() -> torch.Tensor:
    """The multiples of the amax scale the "mse" rule tries: 2**(j/64), j = -64..64 (an octave
    of finer and coarser grids, and every offset of E4M3's grid against the data within it)."""
    return torch.exp2(torch.arange(-64, 65, dtype=torch.float32) / 64)


def scale_errors(x: torch.Tensor, base: torch.Tensor, kind: str, mults: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """Summed squared error [M, H] of ``x`` [B, H, T, D] rounded to the ``kind`` grid under each
    scale ``scales_from_amax(base * mults[m])`` (``base`` [H]: each head's amax). On CPU through
    the extension's ``kv_scale_errors`` where it is built (the same terms, summed in fp64; about
    20x (fp8) and 10x (int8) faster than ``scale_errors_reference`` on 2 cores)."""
    x = x.detach().float()
    s = scales_from_amax(base.to(x.device, torch.float32)[None, :] * mults.to(x.device)[:, None], kind)  # [M, H]
    if x.is_cpu and load_cpu_ext() is not None:
        heads = x.transpose(0, 1).reshape(x.shape[1], -1)
        return torch.ops.quantspec_cpu.kv_scale_errors.default(heads, s, 0 if kind == "fp8" else 1)
    return scale_errors_reference(x, s, kind, chunk)


def scale_errors_reference(x: torch.Tensor, scales: torch.Tensor, kind: str, chunk: int = 16) -> torch.Tensor:
    """``scale_errors`` in torch: ``x`` [B, H, T, D] fp32 under ``scales`` [M, H] -> [M, H]."""
    out = []
    for s in scales.split(chunk):
        s = s[:, None, :, None, None]  # [m, 1, H, 1, 1]
        out.append(((round_codes(x[None] / s, kind) * s - x[None]) ** 2).sum(dim=(1, 3, 4)))
    return torch.cat(out)


class KVObserver(DynamicCache):
    """A DynamicCache that also records, per layer, each KV head's max |key| and max |value|;
    with ``keep``, also the keys and values written (``kept``: layer -> (keys, values), the
    tensors themselves, not copies)."""

    def __init__(self, config=None, keep: bool = False):
        super().__init__(config=config)
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (k amax [H], v amax [H])
        self.keep = keep
        self.kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keep:
            if layer_idx in self.kept:  # a second write to a layer (not in one calibration forward)
                k0, v0 = self.kept[layer_idx]
                self.kept[layer_idx] = (torch.cat([k0, key_states.detach()], 2), torch.cat([v0, value_states.detach()], 2))
            else:
                self.kept[layer_idx] = (key_states.detach(), value_states.detach())
        k = key_states.detach().abs().float().amax(dim=(0, 2, 3)).cpu()
        v = value_states.detach().abs().float().amax(dim=(0, 2, 3)).cpu()
        if layer_idx in self.stats:
            k0, v0 = self.stats[layer_idx]
            k, v = torch.maximum(k0, k), torch.maximum(v0, v)
        self.stats[layer_idx] = (k, v)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class KVErrorObserver(DynamicCache):
    """A DynamicCache that also sums, per layer, the squared error of its keys and values under
    each candidate scale (``scale_errors``) around ``base`` (layer -> (k amax [H], v amax [H]))."""

    def __init__(self, base: dict[int, tuple[torch.Tensor, torch.Tensor]], kind: str, mults: torch.Tensor, config=None):
        super().__init__(config=config)
        self.base, self.kind, self.mults = base, kind, mults
        self.stats: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (k errors [M, H], v errors)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        kb, vb = self.base[layer_idx]
        k = scale_errors(key_states, kb, self.kind, self.mults).cpu()
        v = scale_errors(value_states, vb, self.kind, self.mults).cpu()
        if layer_idx in self.stats:
            k, v = self.stats[layer_idx][0] + k, self.stats[layer_idx][1] + v
        self.stats[layer_idx] = (k, v)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


class KVQuantizer:
    """Rounds the keys and values a cache stores: ``setting`` and, for calibrated scales,
    ``scales`` (layer -> (k_scale, v_scale), each a scalar or [kv_heads] tensor; unused for
    "unit" and "dynamic"). ``quantizer(x, layer_idx, which)``: x [B, H, T, D] of one cache
    write (which 0: keys, 1: values), fake-quantized."""

    def __init__(self, setting: KVSetting, scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None):
        if setting.scales == "calibrated" and not scales:
            raise QuantspecError("calibrated KV scales were asked for, but none were given.",
                                 "calibrate them (quantspec quantize --kv-cache) or use unit/dynamic scales.")
        self.setting = setting
        self.scales = scales or {}

    def scale(self, x: torch.Tensor, layer_idx: int, which: int) -> torch.Tensor:
        if self.setting.scales == "unit":
            return torch.ones(())
        if self.setting.scales == "dynamic":  # one per-tensor scale per cache write
            return scales_from_amax(x.detach().abs().amax().float(), self.setting.kind)
        if layer_idx not in self.scales:
            raise QuantspecError(f"no calibrated KV scale for layer {layer_idx}.",
                                 "recalibrate the checkpoint's KV scales.")
        return self.scales[layer_idx][which]

    def __call__(self, x: torch.Tensor, layer_idx: int, which: int) -> torch.Tensor:
        return fake_quant(x, self.scale(x, layer_idx, which), self.setting.kind)


class QuantKVCache(DynamicCache):
    """A DynamicCache whose stored keys and values are rounded by ``KVQuantizer(setting, scales)``."""

    def __init__(self, setting: KVSetting, scales: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None,
                 config=None):
        super().__init__(config=config)
        self.quantizer = KVQuantizer(setting, scales)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        k = self.quantizer(key_states, layer_idx, 0)
        v = self.quantizer(value_states, layer_idx, 1)
        return super().update(k, v, layer_idx, *args, **kwargs)


def resolve_kv(model, kind: str = "checkpoint", scales: str = "calibrated"
               ) -> tuple[KVSetting, dict[int, tuple[torch.Tensor, torch.Tensor]] | None] | None:
    """The KV cache a forward of ``model`` should run on: ``kind`` "checkpoint" (what the
    checkpoint declares, none for a checkpoint without KV scales), "off", "fp8" or "int8";
    ``scales`` "calibrated" (the checkpoint's; for the other kind, rescaled from the same maxima),
    "unit" or "dynamic". None: a plain cache."""
    ckpt = getattr(model, "quantspec_kv_cache", None)  # set by checkpoint.load_quantized
    if scales != "calibrated" and (kind == "off" or (kind == "checkpoint" and ckpt is None)):
        raise QuantspecError(f"{scales} KV scales were asked for, and the KV cache is not quantized "
                             f"({'off' if kind == 'off' else 'the model declares none'}).",
                             "name the cache to quantize (--kv-cache fp8 or int8), or drop the scales.")
    if kind == "off" or (kind == "checkpoint" and ckpt is None):
        return None
    if kind == "checkpoint":
        kind = ckpt[0].kind
    if scales != "calibrated":
        return KVSetting(kind, scales), None
    if ckpt is None:
        raise QuantspecError("calibrated KV scales were asked for, but the model has none.",
                             "quantize with --kv-cache fp8, or use --kv-scales unit or dynamic.")
    # a calibrated scale is amax / top code: the same maxima serve the other kind, rescaled
    ratio = KV_MAX[ckpt[0].kind] / KV_MAX[kind]
    scales = ckpt[1] if ratio == 1 else {i: (k * ratio, v * ratio) for i, (k, v) in ckpt[1].items()}
    return KVSetting(kind, "calibrated"), scales


def kv_quantizer(model) -> KVQuantizer | None:
    """The rounding of a decode of ``model``'s cache writes (``resolve_kv``'s default: the
    checkpoint's KV scales), None for a plain cache."""
    kv = resolve_kv(model)
    return None if kv is None else KVQuantizer(*kv)


def new_cache(model) -> DynamicCache:
    """The cache a decode of ``model`` writes: a QuantKVCache when its checkpoint declares KV
    scales (``resolve_kv``'s default), else a plain DynamicCache."""
    kv = resolve_kv(model)
    return DynamicCache(config=model.config) if kv is None else QuantKVCache(*kv, config=model.config)
