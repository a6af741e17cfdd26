"""Resume journals and AWQ scales files are tied to every byte of the weights they were made
from: a model with the same config and one weight changed (a fine-tune) is refused, not mixed in."""

from __future__ import annotations

import copy

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

import quantspec
from quantspec.cli.main import main
from quantspec.errors import QuantspecError
from quantspec.quant.recipe import CalibrationConfig, Recipe
from quantspec.quant.resume import ResumeState
from quantspec.core.scheme import QuantScheme

from helpers import make_tiny_model

# Flat index 1 of a [128, 64] MLP weight: the old fingerprints hashed every 2nd element of it
# (AWQ: numel // 4096) and no block weight at all (resume), so this change went unseen.
CHANGED = ("model.layers.1.mlp.gate_proj.weight", 1)


def change_one_weight(folder, key: str, index: int) -> None:
    """Add 0.5 to one element of ``key`` in the model's safetensors file (the config stays)."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    tensors[key].view(-1)[index] += 0.5
    save_file(tensors, str(path), metadata={"format": "pt"})


def calib_text(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"token{i % 97} word{i % 13}" for i in range(4000)))
    return text


def test_module_digest_sees_every_element_and_dtype():
    from quantspec.quant.digest import module_digest

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(300, 200), nn.LayerNorm(200))
    base = module_digest(block)
    assert module_digest(copy.deepcopy(block)) == base  # the bytes count, not where they live
    for p in block.parameters():
        for index in (0, p.numel() // 2 + 1, p.numel() - 1):
            with torch.no_grad():
                old = p.view(-1)[index].item()
                p.view(-1)[index] = old + 1e-3
                assert module_digest(block) != base, (p.shape, index)
                p.view(-1)[index] = old
    assert module_digest(block) == base
    assert module_digest(block.to(torch.float64)) != base


class _Stop(Exception):
    pass


def interrupt_after(monkeypatch, blocks: int) -> None:
    """Make the engine stop once ``blocks`` blocks are journaled (as a kill would)."""
    real = ResumeState.save_block

    def save_then_stop(self, record, *args, **kwargs):
        real(self, record, *args, **kwargs)
        if record.index + 1 == blocks:
            raise _Stop

    monkeypatch.setattr(ResumeState, "save_block", save_then_stop)


def tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def interrupted(tmp_path, monkeypatch, blocks: int, streaming: bool = True, **model):
    """A tiny GPTQ run journaled in ``.out.resume`` and stopped after ``blocks`` blocks; returns
    the model folder and ``run(out)``, which quantizes it with ``resume``."""
    torch.set_num_threads(1)
    tiny = make_tiny_model(tmp_path, "llama", **model)
    recipe = Recipe(name="t", method="gptq", format="gptq", scheme=QuantScheme(4, 32),
                    calibration=CalibrationConfig(data=str(calib_text(tmp_path)), samples=4, seqlen=32))

    def run(out, resume=True):
        return quantspec.quantize(str(tiny), recipe, out, progress=False, streaming=streaming, resume=resume)

    with monkeypatch.context() as m:
        interrupt_after(m, blocks)
        with pytest.raises(_Stop):
            run(tmp_path / "out")
    return tiny, run


@pytest.mark.parametrize("streaming", [True, False], ids=["streaming", "in-memory"])
def test_resume_refuses_a_finished_block_of_another_model(tmp_path, monkeypatch, streaming):
    tiny, run = interrupted(tmp_path, monkeypatch, 2, streaming, num_hidden_layers=4)
    change_one_weight(tiny, *CHANGED)  # block 1 is journaled as finished
    with pytest.raises(QuantspecError, match=r"block 1 \(model.layers.1\) of another model") as exc:
        run(tmp_path / "out")
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "out").exists()


def test_resume_continues_when_only_an_unfinished_block_changed(tmp_path, monkeypatch):
    """The check is per finished block: a change in a block still to do cannot have reached
    the journal, so the run continues and ends as a fresh run on the changed model."""
    tiny, run = interrupted(tmp_path, monkeypatch, 2, num_hidden_layers=4)
    change_one_weight(tiny, "model.layers.3.mlp.gate_proj.weight", 1)
    resumed, fresh = run(tmp_path / "out"), run(tmp_path / "fresh", resume=False)
    assert resumed.report["resumed_blocks"] == 2 and fresh.report["resumed_blocks"] == 0
    a, b = tensors(fresh.out), tensors(resumed.out)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_refuses_another_embedding(tmp_path, monkeypatch):
    """Tensors outside the blocks (the embedding: block 0's inputs) are covered too; row 1 of
    a 1024-row embedding was outside the old sample (every 4th row)."""
    tiny, run = interrupted(tmp_path, monkeypatch, 1, num_hidden_layers=3, vocab_size=1024)
    change_one_weight(tiny, "model.embed_tokens.weight", 64 + 5)  # row 1
    with pytest.raises(QuantspecError, match="different model"):
        run(tmp_path / "out")


def test_load_scales_refuses_another_models_block(tmp_path, capsys):
    tiny = make_tiny_model(tmp_path, "llama")
    scales = tmp_path / "scales.safetensors"
    args = ["quantize", str(tiny), "--method", "awq", "--bits", "4", "--group-size", "32",
            "--calib", str(calib_text(tmp_path)), "--calib-samples", "4", "--calib-seqlen", "32", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "a"), "--save-scales", str(scales)]) == 0
    assert main([*args, "--out", str(tmp_path / "b"), "--load-scales", str(scales)]) == 0  # same model: loads
    capsys.readouterr()
    change_one_weight(tiny, *CHANGED)
    assert main([*args, "--out", str(tmp_path / "c"), "--load-scales", str(scales)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("quantspec: error: AWQ scales file has no scales for block model.layers.1 ")
    assert not (tmp_path / "c").exists()
