"""Casting QuantLinear layers (``.to(dtype)``, ``.half()``, ``.bfloat16()``, ``.float()``)
changes their compute dtype only: the format's tensors and the backend's prepared layout keep
their bytes, and the layer then computes what a layer built in that dtype computes.

Oracle: a QuantLinear built in the target dtype from the same QuantResult, run by the reference
backend. Tolerances are the backends' own: the reference must be exactly equal (same
computation); cpu: relative Frobenius error EXT_TOL (extension) or TORCH_TOL (torch's ops) in
fp32 and BF16_TOL in bf16/fp16 (tests/test_cpu_backend.py); triton: TOL[dtype] of
tests/test_triton_kernels.py, run in Triton's interpreter in a subprocess (see
``test_triton_casts_in_interpreter``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_cpu_backend import BF16_TOL, EXT_TOL, TORCH_TOL, rel_err
from test_triton_kernels import TOL, check_close, make_case

import quantspec
from quantspec.errors import QuantspecError
from quantspec.kernels.cpu_ext import load_cpu_ext
from quantspec.kernels.quant_linear import QuantLinear
from quantspec.quant.recipe import Recipe
from quantspec.core.scheme import QuantScheme

from helpers import make_tiny_model

INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
BACKENDS = ("triton",) if INTERPRETING else ("reference", "cpu")
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
# name -> (dtype the layer is built in, the cast, the dtype it computes in after)
CASTS = {
    "to_bf16": (F32, lambda m: m.to(BF16), BF16),
    "half": (F32, lambda m: m.half(), F16),
    "bfloat16": (F32, lambda m: m.bfloat16(), BF16),
    "float": (BF16, lambda m: m.float(), F32),
}
LAYERS = [  # fp16 scales with zeros and act-order g_idx; W8A8's int8 weight and fp16 scales
    ("gptq", QuantScheme(4, 32, False, act_order=True)),
    ("compressed-tensors", QuantScheme(8, -1, True, activations="int8-token-dynamic")),
]
N, K, M = 48, 256, 5

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def build(r, fmt, bias, dtype, backend) -> QuantLinear:
    mod = QuantLinear.from_result(r, fmt, bias.to(dtype), dtype)
    mod.prepare(backend)
    return mod


def packed(mod: QuantLinear) -> dict[str, torch.Tensor]:
    """The format's tensors and the prepared layout, by name."""
    return {**mod.format_tensors(), **{f"_p_{k}": v for k, v in mod.prepared().items()}}


def assert_same_bytes(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> None:
    assert before.keys() == after.keys()
    for name, t in before.items():
        u = after[name]
        assert (u.dtype, u.shape, u.device) == (t.dtype, t.shape, t.device), name
        as_bytes = [v.contiguous().reshape(-1).view(torch.uint8) for v in (t, u)]
        assert torch.equal(*as_bytes), f"{name} changed"


def tolerance(backend: str, dtype: torch.dtype) -> float:
    if backend == "cpu" and dtype == F32:
        return EXT_TOL if load_cpu_ext() is not None else TORCH_TOL
    return BF16_TOL if backend == "cpu" else TOL[dtype]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cast", CASTS)
@pytest.mark.parametrize("fmt,scheme", LAYERS, ids=lambda v: v if isinstance(v, str) else v.short_name)
def test_cast_keeps_packed_bytes_and_computes_in_new_dtype(backend, cast, fmt, scheme):
    start, apply, target = CASTS[cast]
    r, x, b = make_case(scheme, N, K, M, F32, seed=3)
    mod = build(r, fmt, b, start, backend)
    before = {name: t.clone() for name, t in packed(mod).items()}
    assert apply(mod) is mod
    assert mod.compute_dtype == target and mod.bias.dtype == target
    assert_same_bytes(before, packed(mod))
    x = x.to(target)
    with torch.no_grad():
        y = mod(x)
        y_ref = build(r, fmt, b.to(start), target, "reference")(x)
    assert y.dtype == target
    if backend == "reference":
        assert torch.equal(y, y_ref)
    elif backend == "triton":
        check_close(y, y_ref, target)
    else:
        assert rel_err(y, y_ref) < tolerance(backend, target)


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_move_keeps_packed_dtypes(backend):
    """A move and a cast at once: every tensor moves, only the bias changes dtype."""
    fmt, scheme = LAYERS[0]
    r, _, b = make_case(scheme, N, K, M, F32)
    mod = build(r, fmt, b, F32, backend)
    before = packed(mod)
    mod.to("meta", BF16)
    after = packed(mod)
    assert {n: (t.dtype, t.device.type) for n, t in after.items()} == {
        n: (t.dtype, "meta") for n, t in before.items()
    }
    assert (mod.bias.dtype, mod.bias.device.type, mod.compute_dtype) == (BF16, "meta", BF16)


def test_unsupported_compute_dtype_is_refused_before_the_layer_changes():
    """The cpu backend runs fp32/bf16/fp16 activations only: ``.double()`` is refused at once
    (a QuantspecError naming the dtype and the fix); the reference runs it."""
    fmt, scheme = LAYERS[0]
    r, x, b = make_case(scheme, N, K, M, F32)
    mod = build(r, fmt, b, F32, "cpu")
    before = {name: t.clone() for name, t in packed(mod).items()}
    with pytest.raises(QuantspecError, match=r"float64.*backend='reference'"):
        mod.double()
    assert mod.compute_dtype == F32 and mod.bias.dtype == F32
    assert_same_bytes(before, packed(mod))
    ref = build(r, fmt, b, F32, "reference").double()
    with torch.no_grad():
        y = ref(x.double())
        y_ref = build(r, fmt, b, torch.float64, "reference")(x.double())
    assert y.dtype == torch.float64 and torch.equal(y, y_ref)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cast")
    tiny = make_tiny_model(tmp, "llama")
    recipe = Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(4, 32, False))
    return quantspec.quantize(str(tiny), recipe, tmp / "ckpt", progress=False).out


@pytest.mark.skipif(INTERPRETING, reason="run by the parent process")
@pytest.mark.parametrize("backend", ("reference", "cpu"))
def test_loaded_model_cast_to_bf16(ckpt, backend):
    """The issue's case: ``load_quantized(dir).to(torch.bfloat16)`` then a forward; packed
    tensors unchanged. Oracle: the checkpoint loaded in bf16 on the reference backend, with the
    dense modules' float buffers (rotary frequencies) cast to bf16 as the cast leaves them."""
    model = quantspec.load_quantized(ckpt, backend=backend)
    quantized = {n for n, m in model.named_modules() if isinstance(m, QuantLinear)}

    def packed_state():
        return {k: v.clone() for k, v in model.state_dict().items() if k.rpartition(".")[0] in quantized}

    before = packed_state()
    model.to(BF16)
    assert_same_bytes(before, packed_state())
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    ref = quantspec.load_quantized(ckpt, dtype=BF16, backend="reference")
    for mod in ref.modules():  # what the cast does to the dense modules' float buffers (rotary)
        for name, buf in mod.named_buffers(recurse=False):
            if buf.is_floating_point() and not isinstance(mod, QuantLinear):
                setattr(mod, name, buf.to(BF16))
    with torch.no_grad():
        logits, ref_logits = model(ids).logits, ref(ids).logits
    assert logits.dtype == BF16
    if backend == "reference":
        assert torch.equal(logits, ref_logits)
    else:
        assert rel_err(logits, ref_logits) < BF16_TOL


def test_triton_casts_in_interpreter():
    """Run this file's triton cases in a subprocess with TRITON_INTERPRET=1 (the variable must
    be set before triton is imported; see tests/test_triton_kernels.py)."""
    pytest.importorskip("triton")
    if INTERPRETING:
        pytest.skip("already inside the interpreter run")
    env = {**os.environ, "TRITON_INTERPRET": "1", "QUANTSPEC_CPU_EXT": "0"}  # no cpu case runs there
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           "-k", "triton and not in_interpreter", __file__]
    proc = subprocess.run(cmd, env=env, cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
