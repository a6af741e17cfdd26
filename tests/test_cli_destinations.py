"""No command may change its inputs or delete a folder it did not write; flags that would do
nothing, or are out of range, are refused in one line (exit 2) before any model loads."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import make_tiny_model

from quantspec.cli.main import main


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


@pytest.fixture(scope="module")
def ckpt(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "q"
    assert main(["quantize", str(tiny), "--method", "rtn", "--bits", "4", "--group-size", "32",
                 "--out", str(out), "--no-progress"]) == 0
    return out


def _snapshot(folder):
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(argv, capsys, needle):
    rc = main(argv)
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[")]  # progress lines
    assert rc == 2, err
    assert len(err) == 1 and err[0].startswith("quantspec: error:") and needle in err[0], err


@pytest.mark.parametrize("where", ["same", "parent"])
def test_quantize_overwrite_never_deletes_its_input(tiny, tmp_path, capsys, where):
    model = tmp_path / "m"
    shutil.copytree(tiny, model)
    (tmp_path / "precious.txt").write_text("keep")
    before = _snapshot(tmp_path)
    out = model if where == "same" else tmp_path
    _refused(["quantize", str(model), "--method", "rtn", "--out", str(out), "--overwrite", "--no-progress"],
             capsys, "overwrite")
    assert _snapshot(tmp_path) == before


def test_quantize_overwrite_replaces_only_a_checkpoint(tiny, ckpt, tmp_path, capsys):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "a.txt").write_text("mine")
    _refused(["quantize", str(tiny), "--method", "rtn", "--out", str(other), "--overwrite", "--no-progress"],
             capsys, "not an output of this kind")
    assert (other / "a.txt").read_text() == "mine"
    again = tmp_path / "again"
    shutil.copytree(ckpt, again)
    assert main(["quantize", str(tiny), "--method", "rtn", "--bits", "8", "--out", str(again), "--overwrite",
                 "--no-progress"]) == 0  # an earlier checkpoint is still replaced
    assert json.loads((again / "config.json").read_text())["quantization_config"]["bits"] == 8


def test_json_never_overwrites_an_input_file(ckpt, tmp_path, capsys):
    held = tmp_path / "q"
    shutil.copytree(ckpt, held)
    before = _snapshot(held)
    _refused(["inspect", str(held), "--json", str(held / "config.json")], capsys, "would overwrite the input")
    _refused(["inspect", str(held), "--json", str(tmp_path)], capsys, "is a folder")
    assert _snapshot(held) == before
    assert main(["inspect", str(held), "--json", str(held / "inspect.json")]) == 0  # a new file beside it is fine


def test_train_draft_out_must_be_a_head_folder(tiny, ckpt, tmp_path, capsys):
    target = tmp_path / "t"
    shutil.copytree(tiny, target)
    before = _snapshot(target)
    small = ["--samples", "4", "--seqlen", "16", "--epochs", "1", "--prompts", "text", "--no-progress"]
    _refused(["train-draft", str(target), "--out", str(target), "--overwrite", *small], capsys, "overwrite")
    assert _snapshot(target) == before
    held = tmp_path / "q"
    shutil.copytree(ckpt, held)
    before = _snapshot(held)
    _refused(["train-draft", str(tiny), "--out", str(held), *small], capsys, "no EAGLE head")
    _refused(["train-draft", str(tiny), "--out", str(tmp_path / "h"), "--threads", "-3", *small], capsys,
             "--threads -3")
    assert _snapshot(held) == before


def test_profile_refuses_before_loading_and_leaves_nothing(ckpt, tmp_path, capsys):
    out = tmp_path / "prof"
    _refused(["profile", str(tmp_path / "missing"), "--out", str(out)], capsys, "missing")
    for flag in ("--decode-steps", "--prompt-length", "--batch-size"):
        _refused(["profile", str(ckpt), "--out", str(out), flag, "0"], capsys, "not positive")
    assert not out.exists()
    held = tmp_path / "q"
    shutil.copytree(ckpt, held)
    _refused(["profile", str(ckpt), "--out", str(held), "--no-progress"], capsys, "not an earlier profile")


def test_bench_refuses_a_decode_prompt_of_no_tokens(ckpt, capsys):
    _refused(["bench", str(ckpt), "--decode-prompt-length", "0"], capsys, "decode_prompt_length=0")


@pytest.mark.parametrize("argv,needle", [
    (["--tasks", " , "], "names no task"),
    (["--limit", "5"], "no --tasks was given"),
    (["--tasks-path", "."], "no --tasks was given"),
    (["--tasks", "x", "--limit", "0"], "--limit 0 is not positive"),
    (["--kv-scales", "unit"], "the model declares none"),
    (["--kv-cache", "off", "--kv-scales", "dynamic"], "(off)"),
])
def test_eval_refuses_flags_that_would_do_nothing(ckpt, tmp_path, capsys, argv, needle):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(600)))
    _refused(["eval", str(ckpt), "--ppl", str(text), "--seqlen", "32", "--windows", "2", "--no-progress", *argv],
             capsys, needle)


def test_errors_print_on_one_line(monkeypatch, capsys):
    import quantspec.cli.inspect as inspect_cli
    from quantspec.errors import QuantspecError

    def fail(args):
        raise QuantspecError("a message quoted\nfrom another library.", "the fix.")

    monkeypatch.setattr(inspect_cli, "run", fail)
    rc = main(["inspect", "anything"])
    assert rc == 2
    assert capsys.readouterr().err == "quantspec: error: a message quoted from another library. Fix: the fix.\n"


def test_a_checkpoint_that_lost_its_quantization_config_says_so(ckpt, tmp_path, capsys):
    held = tmp_path / "q"
    shutil.copytree(ckpt, held)
    config = json.loads((held / "config.json").read_text())
    del config["quantization_config"]
    (held / "config.json").write_text(json.dumps(config))
    (held / "quantspec.checksums.json").unlink()
    rc = main(["generate", str(held), "--prompt", "hi", "--max-new-tokens", "2"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("quantspec")]
    assert rc == 2 and len(err) == 1 and "has no quantization_config" in err[0], err


def test_a_missing_checkpoint_is_called_missing(tmp_path, capsys):
    rc = main(["inspect", str(tmp_path / "nowhere")])
    assert rc == 2 and "nowhere does not exist" in capsys.readouterr().err
