"""gptq.forward_dtype: the single pass's block forwards (the quantized one and asymmetric
calibration's float one) under bf16 autocast, reported per layer; float32 leaves them as they
were; auto follows the device; the per-group path stays fp32."""

from __future__ import annotations

import copy

import pytest
import torch

from quantspec.core.scheme import QuantScheme
from quantspec.errors import QuantspecError
from quantspec.quant.arch import block_linears
from quantspec.quant.arch_infer import get_arch
from quantspec.quant.block_methods import GPTQMethod
from quantspec.quant.calibrate import run_blockwise
from quantspec.quant.recipe import GPTQOptions

from helpers import tiny_model

SCHEME = QuantScheme(bits=4, group_size=32)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls on a shared CPU


def _calib(n: int = 6, L: int = 24) -> torch.Tensor:
    return torch.randint(0, 128, (n, L), generator=torch.Generator().manual_seed(1))


def _run(options: GPTQOptions, seen: list | None = None):
    """GPTQ of a tiny Llama under ``options``; ``seen`` collects (layer, output dtype) of every
    planned Linear call on the whole calibration batch (the single pass's forwards; the check of
    whether a block batches runs 1-2 samples)."""
    model = tiny_model("llama", num_hidden_layers=2, vocab_size=128, intermediate_size=160, max_position_embeddings=64)
    arch = get_arch(model)
    ids = _calib()
    plan = {n: SCHEME for n in block_linears(model, arch)}
    def record(name):
        def hook(mod, args, out):
            if out.shape[0] == len(ids):
                seen.append((name, out.dtype))
        return hook

    handles = [model.get_submodule(n).register_forward_hook(record(n)) for n in plan] if seen is not None else []
    report: dict = {}
    res = run_blockwise(model, arch, ids, GPTQMethod(options), plan, progress=False, report=report)
    for h in handles:
        h.remove()
    return res, report, plan


@pytest.mark.parametrize("asymmetric", [False, True])
def test_bf16_forward_runs_every_planned_linear_in_bf16_and_says_so(asymmetric):
    seen32: list = []
    seen16: list = []
    base = dict(block_size=16, hessian_dtype="float32", single_pass_gb=2.0, asymmetric=asymmetric)
    res32, rep32, plan = _run(GPTQOptions(**base), seen32)
    res16, rep16, _ = _run(GPTQOptions(**base, forward_dtype="bfloat16"), seen16)
    # the quantized forward calls each Linear once, the float one (asymmetric) once more
    calls = len(plan) * (2 if asymmetric else 1)
    assert len(seen32) == len(seen16) == calls
    assert {d for _, d in seen32} == {torch.float32}
    assert {d for _, d in seen16} == {torch.bfloat16}
    for n in plan:
        assert (rep32[n]["forward_dtype"], rep16[n]["forward_dtype"]) == ("float32", "bfloat16"), n
        assert rep16[n]["gptq_pass"] == "single"
    # block 0's q/k/v read the same (fp32) embeddings either way: the same Hessian, the same codes
    first = "model.layers.0.self_attn.q_proj"
    assert res16[first].qweight.equal(res32[first].qweight)
    # later layers see bf16-rounded inputs: a few codes move, the error of the whole stays
    assert any(not res16[n].qweight.equal(res32[n].qweight) for n in plan)
    total = {d: sum(r[n]["rel_mse"] for n in plan) for d, r in (("32", rep32), ("16", rep16))}
    assert total["16"] == pytest.approx(total["32"], rel=0.1)


def test_per_group_path_stays_fp32_and_reports_it():
    seen: list = []
    _, rep, plan = _run(GPTQOptions(block_size=16, single_pass_gb=0.0, forward_dtype="bfloat16"), seen)
    assert seen == []  # one sample at a time, fp32 (nothing batched under autocast)
    assert {rep[n]["forward_dtype"] for n in plan} == {"float32"}
    assert {rep[n]["gptq_pass"] for n in plan} == {"per-group"}


def test_forward_dtype_auto_follows_the_device(monkeypatch):
    import contextlib

    import quantspec.quant.precision as precision

    block = torch.nn.Linear(4, 4)
    for native in (True, False):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda: native)
        factory = precision.forward_precision(block, "auto")
        assert (factory is not contextlib.nullcontext) is native
        assert precision.precision_name(block, factory) == ("bfloat16" if native else "float32")
    assert precision.forward_precision(block, "float32") is contextlib.nullcontext
    # a model already in half precision runs as it is, and is reported as such
    half = copy.deepcopy(block).to(torch.float16)
    factory = precision.forward_precision(half, "bfloat16")
    assert factory is contextlib.nullcontext and precision.precision_name(half, factory) == "float16"


def test_bad_forward_dtype_and_the_cli_flag():
    from quantspec.cli.main import build_parser
    from quantspec.cli.quantize import recipe_from_args

    with pytest.raises(QuantspecError, match="forward_dtype"):
        GPTQOptions(forward_dtype="fp16")
    parse = build_parser().parse_args
    assert recipe_from_args(parse(["quantize", "--method", "gptq"])).gptq.forward_dtype == "float32"
    got = recipe_from_args(parse(["quantize", "--method", "gptq", "--gptq-forward-dtype", "bfloat16"]))
    assert got.gptq.forward_dtype == "bfloat16"
    with pytest.raises(QuantspecError, match="--gptq-forward-dtype is a GPTQ setting"):
        recipe_from_args(parse(["quantize", "--method", "rtn", "--gptq-forward-dtype", "auto"]))


@pytest.mark.parametrize("native", [False, True])
def test_bf16_asked_where_it_is_emulated_is_said_before_the_work(native, monkeypatch):
    """bfloat16 named explicitly on a device without native bf16 products (emulated there, ~3x
    slower) is said before calibrating, for the sections the method reads; auto never is."""
    import warnings

    from quantspec.formats import get_format
    from quantspec.quant import job
    from quantspec.quant.precision import emulated_bf16
    from quantspec.quant.recipe import Recipe
    from quantspec.quant.registry import option_sections

    bf16 = {"gptq": {"forward_dtype": "bfloat16", "hessian_dtype": "auto"}, "awq": {"search_dtype": "bfloat16"}}
    recipe = Recipe.from_dict({"method": "awq+gptq", **bf16})
    sections = {n: getattr(recipe, n) for n in option_sections("awq+gptq")}
    assert emulated_bf16(sections, native) == ([] if native else ["awq.search_dtype", "gptq.forward_dtype"])
    rtn = Recipe.from_dict({"method": "rtn", **bf16})  # RTN reads neither section
    assert emulated_bf16({n: getattr(rtn, n) for n in option_sections("rtn")}, False) == []

    monkeypatch.setattr(job, "native_bf16", lambda device: native)
    model = tiny_model()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(QuantspecError, match="needs calibration data"):  # the first check after it
            job.prepare(model, None, Recipe.from_dict({"method": "gptq", **bf16}), get_format("gptq"),
                        torch.device("cpu"))
    said = [str(w.message) for w in seen if "without native bf16" in str(w.message)]
    assert said == ([] if native else [
        ("gptq.forward_dtype=bfloat16 on cpu without native bf16 products: bf16 is emulated there, slower than "
         "float32 (gptq.forward_dtype: auto takes float32 on this device).")])
