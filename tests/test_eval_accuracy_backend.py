"""Accuracy is measured on the scheme a checkpoint declares: ``quantspec eval`` of a weight-only
(W4A16) checkpoint gives the perplexity of the float model with the dequantized weights, and every
JSON names the kernels that computed it."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_model

from quantspec.cli.main import main
from quantspec.kernels.backend import available_backends, choose_backend
from quantspec.core.scheme import QuantScheme

# Both sides compute in fp32 from the same dequantized weights; only the order of the sums differs
# (K <= 128 here), which moves logits by ~1e-6 relative: a perplexity agrees to 1e-5 relative.
FP32_REL = 1e-5
W4 = QuantScheme(bits=4, group_size=32)
W8A8 = QuantScheme(bits=8, group_size=-1, activations="int8-token-dynamic")
CPU = torch.device("cpu")
needs_cpu_backend = pytest.mark.skipif("cpu" not in available_backends(), reason="no cpu backend here")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the shared cache keeps the cpu extension's build


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama with peaked logits (large weights), so activation rounding shows in the ppl."""
    return make_tiny_model(tmp_path_factory.mktemp("acc"), "llama", seed=5, initializer_range=0.3)


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory):
    from quantspec.quant.pipeline import quantize
    from quantspec.quant.recipe import Recipe

    out = tmp_path_factory.mktemp("q") / "rtn-w4g32"
    recipe = Recipe(name="rtn-w4g32", method="rtn", format="gptq", scheme=W4)
    quantize(str(tiny), recipe=recipe, out=out, device="cpu", progress=False)
    return out


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "eval.txt"
    path.write_text(" ".join(f"The model number {i % 23} quantizes weights and drafts tokens." for i in range(200)))
    return path


def fake_quantized_ppl(ckpt, text) -> float:
    """Perplexity of the checkpoint as a float model: every QuantLinear swapped for an nn.Linear
    holding its dequantized weight (the dense tensors are the checkpoint's)."""
    from transformers import AutoTokenizer

    from quantspec.checkpoint.load import load_quantized
    from quantspec.eval.perplexity import perplexity
    from quantspec.kernels.quant_linear import QuantLinear

    model = load_quantized(ckpt, backend="reference")
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 14  # 2 blocks x (q, k, v, o, gate, up, down)
    for name, mod in layers:
        linear = torch.nn.Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
        linear.weight.data = mod.quant_result().dequantize(torch.float32)
        if mod.bias is not None:
            linear.bias.data = mod.bias.data.float()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, linear)
    tok = AutoTokenizer.from_pretrained(ckpt)
    return perplexity(model, tok, str(text), seqlen=64, windows=6, progress=False)["ppl"]


def eval_json(ckpt, text, tmp_path, *extra: str) -> dict:
    out = tmp_path / f"eval{'-'.join(extra)}.json"
    argv = ["eval", str(ckpt), "--ppl", str(text), "--seqlen", "64", "--windows", "6", "--no-progress",
            "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_default_eval_is_the_fake_quantized_float_model(tiny, ckpt, text, tmp_path):
    expected = fake_quantized_ppl(ckpt, text)
    got = eval_json(ckpt, text, tmp_path)
    assert got["ppl"][str(text)] == pytest.approx(expected, rel=FP32_REL)
    assert got["kernels"] == {"backend": "reference", "activations": "as declared"}
    assert got["ppl_details"][str(text)]["kernels"] == got["kernels"]


@needs_cpu_backend
def test_rounded_activations_are_a_named_speed_option(tiny, ckpt, text, tmp_path):
    """``--backend auto`` (the fastest, the old default) rounds activations on a CPU (int8, or bf16
    without the C++ extension): its perplexity is off by far more than fp32 noise, and its JSON
    says so."""
    expected = fake_quantized_ppl(ckpt, text)
    fast = eval_json(ckpt, text, tmp_path, "--backend", "auto")
    assert abs(fast["ppl"][str(text)] / expected - 1) > 10 * FP32_REL
    assert fast["kernels"]["backend"] == "cpu"
    assert fast["kernels"]["activations"].startswith("rounded on 14 of 14 quantized layers")


@needs_cpu_backend
def test_exact_keeps_the_declared_activations():
    ref, why = choose_backend(W4, 64, 128, CPU, torch.float32, "exact")
    assert ref.name == "reference" and "cpu: rounds the activations" in why
    assert choose_backend(W4, 64, 128, CPU, torch.float32, "auto")[0].name == "cpu"
    # W8A8 declares int8 activations: the cpu backend computes exactly that scheme
    assert choose_backend(W8A8, 64, 128, CPU, torch.float32, "exact")[0].name == "cpu"


def test_lm_eval_model_defaults_to_the_declared_scheme(ckpt):
    pytest.importorskip("lm_eval")
    from quantspec.eval.lmeval_adapter import register
    from quantspec.eval.perplexity import kernels_used

    lm = register()(path=str(ckpt), device="cpu", batch_size=1)
    assert kernels_used(lm.model) == {"backend": "reference", "activations": "as declared"}
    # lm-eval copies this into its results JSON ("config"), the CLI shim's output included
    assert lm.get_model_info()["quantspec_kernels"] == kernels_used(lm.model)
