"""Originals published only as MXFP4 (GPT-OSS experts) or block FP8 (DeepSeek-V3): the dense copy
quantspec makes of them holds exactly the values the format stands for, transformers reads the
same values from the MXFP4 original, and quantizing the original gives the checkpoint that
quantizing those dense values gives."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import helpers
import pytest
import torch
from safetensors.torch import load_file, save_file

from quantspec.errors import QuantspecError
from quantspec.models.dense_cache import SOURCE_FILE
from quantspec.models.float_original import dequantized_dir
from quantspec.models.source import dense_folder, load_dense

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
BLOCK = 32  # FP8 weight blocks: the tiny DeepSeek-V3's kv_a_proj_with_mqa has 40 rows, a short last block


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QUANTSPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _original(dense: Path, dest: Path, tensors: dict, qcfg: dict) -> Path:
    shutil.copytree(dense, dest)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dest / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(cfg | {"quantization_config": qcfg}))
    return dest


def fp8_original(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny DeepSeek-V3 whose projections are E4M3 with 32 x 32 block scales (as DeepSeek-V3
    ships them, at 128), and the dense values they stand for."""
    dense = helpers.make_tiny_model(tmp_path, "deepseek_v3")
    g = torch.Generator().manual_seed(0)
    stored, want = {}, {}
    for key, w in load_file(str(dense / "model.safetensors")).items():
        if not key.endswith(("_proj.weight", "_mqa.weight")):
            stored[key] = want[key] = w
            continue
        n, k = w.shape
        scale = (0.5 + torch.rand(-(-n // BLOCK), -(-k // BLOCK), generator=g)) * float(w.abs().max()) / 448
        full = torch.ones(n, k)
        for i in range(n):  # the block of each element, written out the slow way
            for j in range(0, k, BLOCK):
                full[i, j:j + BLOCK] = scale[i // BLOCK, j // BLOCK]
        codes = (w / full).to(torch.float8_e4m3fn)
        stored[key], stored[key + "_scale_inv"] = codes, scale
        want[key] = codes.to(torch.float32) * full
    assert stored["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape[0] % BLOCK != 0
    qcfg = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [BLOCK, BLOCK]}
    return _original(dense, tmp_path / "deepseek-fp8", stored, qcfg), want


def mxfp4_original(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A tiny GPT-OSS whose experts are stored as GPT-OSS ships them (``*_blocks`` / ``*_scales``)
    with random codes and exponents, and the dense values they stand for."""
    dense = helpers.make_tiny_model(tmp_path, "gpt_oss")
    g = torch.Generator().manual_seed(1)
    stored, want = {}, {}
    for key, w in load_file(str(dense / "model.safetensors")).items():
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            stored[key] = want[key] = w
            continue
        e, k, n = w.shape  # transformers' dense experts: [E, K (input), N (output)]
        codes = torch.randint(0, 16, (e, n, k), generator=g)
        exps = torch.randint(120, 130, (e, n, k // 32), generator=g)
        values = torch.tensor(E2M1)[codes] * torch.exp2(exps.float() - 127).repeat_interleave(32, dim=2)
        want[key] = values.transpose(1, 2).contiguous()
        packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)  # even column: low nibble
        stored[key + "_blocks"] = packed.reshape(e, n, k // 32, 16)
        stored[key + "_scales"] = exps.to(torch.uint8)
    qcfg = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                                "model.embed_tokens", "lm_head"]}
    return _original(dense, tmp_path / "gpt-oss-mxfp4", stored, qcfg), want


@pytest.mark.parametrize("make", [fp8_original, mxfp4_original], ids=["fp8-deepseek-v3", "mxfp4-gpt-oss"])
def test_dense_copy_holds_the_values_the_format_stands_for(make, tmp_path, cache, capsys):
    original, want = make(tmp_path)
    folder = dense_folder(str(original))
    assert folder == dequantized_dir(original) and folder.is_relative_to(cache)
    assert "dequantizing it once" in capsys.readouterr().err
    got = load_file(str(folder / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        assert got[key].dtype == torch.float32 and torch.equal(got[key], w), key
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    meta = json.loads((folder / SOURCE_FILE).read_text())
    stored = load_file(str(original / "model.safetensors"))
    converted = sum(1 for k in want if k not in stored or stored[k].dtype == torch.float8_e4m3fn)
    assert meta["original"] == str(original.resolve()) and meta["tensors_dequantized"] == converted > 0
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    model, _, _ = load_dense(str(original))  # the copy is reused, not rebuilt
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp and "dequantizing" not in capsys.readouterr().err
    for key, w in want.items():
        if key in dict(model.named_parameters()):
            assert torch.equal(dict(model.named_parameters())[key].detach(), w), key


def test_transformers_reads_the_same_values_from_the_mxfp4_original(tmp_path, cache):
    """transformers' own MXFP4 dequantization of the original (the layout GPT-OSS ships) agrees
    with the dense copy, parameter for parameter."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    original, _ = mxfp4_original(tmp_path)
    theirs = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32,
                                                  quantization_config=Mxfp4Config(dequantize=True))
    ours = AutoModelForCausalLM.from_pretrained(dense_folder(str(original)), dtype=torch.float32)
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        assert torch.equal(p.detach(), mine[name].detach()), name


@pytest.mark.parametrize("make", [fp8_original, mxfp4_original], ids=["fp8-deepseek-v3", "mxfp4-gpt-oss"])
def test_quantizing_the_original_equals_quantizing_its_values(make, tmp_path, cache):
    """`quantspec quantize ORIGINAL` writes the checkpoint that quantizing a dense folder of the
    same values writes, tensor for tensor (RTN W4, experts included)."""
    from quantspec.cli.main import main

    original, want = make(tmp_path)
    dense = tmp_path / "dense-values"
    shutil.copytree(original, dense)
    save_file(want, str(dense / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((dense / "config.json").read_text())
    cfg.pop("quantization_config")
    (dense / "config.json").write_text(json.dumps(cfg))
    outs = []
    for src in (original, dense):
        out = tmp_path / f"q-{src.name}"
        assert main(["quantize", str(src), "--method", "rtn", "--bits", "4", "--group-size", "32", "--no-compare",
                     "--out", str(out)]) == 0
        outs.append(helpers.checkpoint_tensors(out))
    assert sorted(outs[0]) == sorted(outs[1]) and any("experts" in k for k in outs[0])
    for key in outs[0]:
        assert torch.equal(outs[0][key], outs[1][key]), key


def test_an_fp8_weight_without_its_scale_is_refused(tmp_path, cache):
    original, _ = fp8_original(tmp_path)
    tensors = load_file(str(original / "model.safetensors"))
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    save_file(tensors, str(original / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(QuantspecError, match=r"o_proj\.weight has no .*_scale_inv"):
        dense_folder(str(original))
    assert not dequantized_dir(original).exists()
