"""The quantize core's declared layer (issue 28): the method registry drives recipes and the CLI,
composition is data, a method is one module plus one registry entry, resume works on any
source and sink (undeclared architectures included), and ``quantize_model`` quantizes in memory.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import quantspec
from helpers import calib_text, checkpoint_tensors, make_tiny_model, make_tiny_tokenizer
from quantspec.errors import QuantspecError
from quantspec.quant import registry
from quantspec.quant.block_methods import GPTQMethod, RTNMethod
from quantspec.quant.compose import Composed
from quantspec.quant.method import BlockContext, BlockMethod, BlockOutput
from quantspec.quant.recipe import CalibrationConfig, Recipe, SmoothQuantOptions
from quantspec.core.scheme import QuantScheme
from quantspec.quant.smoothquant import SmoothQuantMethod

pytestmark = pytest.mark.usefixtures("one_thread")
W8A8 = QuantScheme(8, -1, True, activations="int8-token-dynamic")


def _calib(tmp_path, samples=4, seqlen=32) -> CalibrationConfig:
    return CalibrationConfig(data=str(calib_text(tmp_path)), samples=samples, seqlen=seqlen)


def test_cli_choices_and_recipe_validation_read_the_registry():
    import argparse

    from quantspec.cli import quantize as cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    action = next(a for a in parser._subparsers._group_actions[0].choices["quantize"]._actions
                  if a.dest == "method")
    assert list(action.choices) == list(registry.METHODS)
    with pytest.raises(QuantspecError, match="smoothquant\\+gptq"):
        Recipe(method="no-such-method")
    assert Recipe(method="smoothquant+gptq", format="compressed-tensors").scheme == W8A8
    with pytest.raises(QuantspecError, match="act_order needs a Hessian"):
        Recipe(method="awq", format="gptq", scheme=QuantScheme(act_order=True, static_groups=True))


def test_composed_methods_are_built_from_their_steps():
    sq_gptq = registry.build_method(Recipe(method="smoothquant+gptq", format="compressed-tensors",
                                           smoothquant=SmoothQuantOptions(alpha=0.7)))
    assert isinstance(sq_gptq, Composed)
    assert isinstance(sq_gptq.smoother, SmoothQuantMethod) and sq_gptq.smoother.options.alpha == 0.7
    assert isinstance(sq_gptq.rounder, GPTQMethod)
    sq = registry.build_method(Recipe(method="smoothquant", format="compressed-tensors"))
    assert isinstance(sq.rounder, RTNMethod)
    awq_gptq = registry.build_method(Recipe(method="awq+gptq"))
    assert awq_gptq.smoother.options.quantize is False and awq_gptq.smoother.options.awq.clip is False


def test_smoothquant_gptq_from_the_cli_equals_the_composed_steps(tmp_path, monkeypatch):
    """SmoothQuant->GPTQ is reachable through the registry alone: the CLI writes the checkpoint,
    equal tensor for tensor to the two steps run by hand, and unlike either step alone."""
    import copy

    from quantspec.cli.main import main
    from quantspec.formats import get_format
    from quantspec.quant.arch_infer import get_arch
    from quantspec.quant.calibrate import run_blockwise
    from quantspec.quant.job import calibration

    folder = make_tiny_model(tmp_path, "llama")
    cal = _calib(tmp_path)
    out = tmp_path / "sq-gptq"
    rc = main(["quantize", str(folder), "--method", "smoothquant+gptq", "--calib", cal.data,
               "--calib-samples", "4", "--calib-seqlen", "32", "--out", str(out), "--no-progress", "--no-streaming"])
    assert rc == 0
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "compressed-tensors"
    written = checkpoint_tensors(out)
    dense = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    recipe = Recipe(method="smoothquant+gptq", format="compressed-tensors", calibration=cal)
    ids, _ = calibration(make_tiny_tokenizer(), recipe, torch.device("cpu"))
    plan = {n: W8A8 for n, m in dense.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"}
    by_hand = {}
    for tag, method in (("both", Composed(SmoothQuantMethod(), GPTQMethod())), ("gptq", GPTQMethod()),
                        ("sq", Composed(SmoothQuantMethod(), RTNMethod()))):
        res = run_blockwise(copy.deepcopy(dense), get_arch(dense), ids, method, plan, progress=False)
        by_hand[tag] = res
    fmt = get_format("compressed-tensors")
    for n, r in by_hand["both"].items():
        for t, v in fmt.pack(r).items():
            assert torch.equal(written[f"{n}.{t}"], v), (n, t)
    for other in ("gptq", "sq"):
        assert any(not torch.equal(by_hand["both"][n].qweight, by_hand[other][n].qweight) for n in plan), other


class HalfRangeRTN(BlockMethod):
    """A toy method: RTN of the weights scaled by 1/2 (so it is told apart from RTN)."""

    needs_calibration = False

    def process_block(self, ctx: BlockContext) -> BlockOutput:
        from quantspec.quant.rtn import rtn

        results = {n: rtn(ctx.block.get_submodule(n[len(ctx.name) + 1:]).weight.detach() / 2, s)
                   for n, s in ctx.plan.items()}
        return BlockOutput(results)


def test_a_new_method_is_one_registry_entry(tmp_path, monkeypatch):
    spec = registry.MethodSpec("half-rtn", "toy", QuantScheme(), build=lambda recipe: HalfRangeRTN())
    monkeypatch.setitem(registry.METHODS, "half-rtn", spec)
    folder = make_tiny_model(tmp_path, "llama")
    out = quantspec.quantize(str(folder), Recipe(method="half-rtn"), tmp_path / "half", progress=False)
    plain = quantspec.quantize(str(folder), Recipe(method="rtn", scheme=QuantScheme()), tmp_path / "rtn",
                               progress=False)
    a, b = checkpoint_tensors(out.out), checkpoint_tensors(plain.out)
    assert a.keys() == b.keys()
    scales = [k for k in a if k.endswith(".scales")]
    assert scales and all(torch.allclose(a[k].float() * 2, b[k].float(), rtol=2e-3) for k in scales)


def _undeclared(tmp_path):
    return make_tiny_model(tmp_path, "opt", num_hidden_layers=3)


def test_resume_on_an_undeclared_architecture(tmp_path, monkeypatch):
    """OPT has no declaration (the resident source, the inferred architecture): a run killed in
    block 2 resumes from the journal, reuses two blocks and equals an uninterrupted run."""
    import quantspec.quant.calibrate as calibrate

    folder = _undeclared(tmp_path)
    recipe = Recipe(name="t", method="gptq", scheme=QuantScheme(4, 32, True), calibration=_calib(tmp_path))
    clean = quantspec.quantize(str(folder), recipe, tmp_path / "clean", progress=False)
    assert clean.report["streaming"] is False
    real = calibrate._process

    def stop_at_block_2(method, ctx):
        if ctx.index == 2:
            raise KeyboardInterrupt
        return real(method, ctx)

    out = tmp_path / "out"
    with monkeypatch.context() as m:
        m.setattr(calibrate, "_process", stop_at_block_2)
        with pytest.raises(KeyboardInterrupt):
            quantspec.quantize(str(folder), recipe, out, progress=False, resume=True)
    assert json.loads((tmp_path / ".out.resume" / "manifest.json").read_text())["done"] == 2
    resumed = quantspec.quantize(str(folder), recipe, out, progress=False, resume=True)
    assert resumed.report["resumed_blocks"] == 2
    a, b = checkpoint_tensors(clean.out), checkpoint_tensors(resumed.out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_quantize_model_in_memory_matches_the_checkpoint(tmp_path):
    """``quantize_model`` swaps QuantLinear modules in with the same packed tensors the checkpoint
    of the same recipe holds."""
    from quantspec.kernels.quant_linear import QuantLinear

    folder = make_tiny_model(tmp_path, "llama")
    recipe = Recipe(name="t", method="gptq", scheme=QuantScheme(4, 32, True), calibration=_calib(tmp_path))
    written = checkpoint_tensors(quantspec.quantize(str(folder), recipe, tmp_path / "ckpt", progress=False).out)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model, report = quantspec.quantize_model(model, recipe, tokenizer=make_tiny_tokenizer(), backend="reference")
    swapped = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert set(swapped) == set(report["quantized"]) and swapped
    for name, mod in swapped.items():
        for t in mod.format_tensors():
            assert torch.equal(getattr(mod, t), written[f"{name}.{t}"]), (name, t)
    with pytest.raises(QuantspecError, match="tokenizer"):
        quantspec.quantize_model(model, recipe)
