"""A loader never loads silently wrong: truncated or flipped bytes anywhere in a checkpoint
either load identical tensors or raise QuantspecError (never another exception, never a
different model)."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

import quantspec
from quantspec.checkpoint.checksums import MANIFEST
from quantspec.errors import QuantspecError
from quantspec.quant.recipe import Recipe
from quantspec.core.scheme import QuantScheme

from helpers import make_tiny_model

CASES = 240


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    tiny = make_tiny_model(base, "llama")
    recipe = Recipe(name="t", method="rtn", format="gptq", scheme=QuantScheme(4, 32, symmetric=False))
    return quantspec.quantize(str(tiny), recipe, base / "ckpt", progress=False).out


def state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_fuzzed_checkpoints_load_identical_or_raise(ckpt, tmp_path):
    reference = state(quantspec.load_quantized(ckpt, backend="reference"))
    files = sorted(p.name for p in ckpt.iterdir() if p.is_file())
    weights = [f for f in files if f.endswith(".safetensors")]
    assert MANIFEST in files and weights
    rng = random.Random(0)
    outcomes = {"raised": 0, "identical": 0}
    for case in range(CASES):
        work = tmp_path / f"c{case}"
        shutil.copytree(ckpt, work)
        # weight the tensors file: it is where a silent corruption would hurt
        name = rng.choice(weights) if rng.random() < 0.5 else rng.choice(files)
        target = work / name
        data = bytearray(target.read_bytes())
        if rng.random() < 0.5 and len(data) > 1:
            data = data[: rng.randrange(len(data))]
        elif data:
            i = rng.randrange(len(data))
            data[i] ^= rng.randrange(1, 256)
        target.write_bytes(bytes(data))
        try:
            loaded = state(quantspec.load_quantized(work, backend="reference"))
        except QuantspecError:
            outcomes["raised"] += 1
        else:
            assert loaded.keys() == reference.keys(), f"case {case}: {name}"
            for k in reference:
                assert torch.equal(loaded[k], reference[k]), f"case {case}: {name} changed {k}"
            outcomes["identical"] += 1
        shutil.rmtree(work)
    assert outcomes["raised"] > CASES * 0.8, outcomes


def test_missing_manifest_still_loads(ckpt, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(ckpt, work)
    (work / MANIFEST).unlink()
    quantspec.load_quantized(work, backend="reference")


@pytest.mark.parametrize("what", ["truncate", "no-config", "bad-json", "wrong-shape", "bad-method"])
def test_broken_checkpoints_without_manifest_raise_clearly(ckpt, tmp_path, what):
    import json

    work = tmp_path / "w"
    shutil.copytree(ckpt, work)
    (work / MANIFEST).unlink()
    cfg_path = work / "config.json"
    if what == "truncate":
        f = sorted(work.glob("*.safetensors"))[0]
        f.write_bytes(f.read_bytes()[:-100])
    elif what == "no-config":
        cfg_path.unlink()
    elif what == "bad-json":
        cfg_path.write_text("{not json")
    elif what == "wrong-shape":
        cfg = json.loads(cfg_path.read_text())
        cfg["intermediate_size"] = cfg["intermediate_size"] * 2
        cfg_path.write_text(json.dumps(cfg))
    elif what == "bad-method":
        cfg = json.loads(cfg_path.read_text())
        cfg["quantization_config"]["quant_method"] = "bitsandbytes"
        cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(QuantspecError):
        quantspec.load_quantized(work, backend="reference")
