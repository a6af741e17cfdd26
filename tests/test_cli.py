"""The CLI: thin subcommands, JSON outputs, exit codes (0 ok, 2 bad input, 1 internal)."""

from __future__ import annotations

import json

import pytest

from quantspec.cli.main import main
from quantspec.errors import QuantspecError

from helpers import make_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


def test_quantize_inspect_eval_generate(tiny, tmp_path, capsys):
    out = tmp_path / "ckpt"
    rc = main([
        "quantize", str(tiny), "--method", "rtn", "--bits", "4", "--group-size", "32",
        "--no-sym", "--format", "gptq", "--out", str(out), "--json", str(tmp_path / "q.json"),
        "--no-progress",
    ])
    assert rc == 0
    q = json.loads((tmp_path / "q.json").read_text())
    assert q["layers_quantized"] == 14 and q["recipe"]["scheme"]["symmetric"] is False
    assert main(["inspect", str(out), "--json", str(tmp_path / "i.json")]) == 0
    info = json.loads((tmp_path / "i.json").read_text())
    assert info["format"] == "gptq" and info["quantized_layers"] == 14
    assert "lm_head" in info["dense_layers"]
    assert all(v["backend"] for v in info["layers"].values() if not v.get("dense"))
    shown = capsys.readouterr().out  # the backends passed over for each layer kind, with the reason
    passed_over = {part for v in info["layers"].values() if not v.get("dense")
                   for part in v["backend_reason"].split("; ") if v["backend_reason"] != "fastest available"}
    from quantspec.kernels.backend import available_backends

    assert passed_over or available_backends()[0] != "triton"  # Triton cannot run on this CPU
    assert all(f"not {part}" in shown for part in passed_over)
    layer = next(v for v in info["layers"].values() if not v.get("dense"))  # every backend, and why not
    assert list(layer["backends"]) == available_backends() and layer["backends"][layer["backend"]] is None
    assert "then marlin: runs on NVIDIA GPUs, not cpu" in shown and "then tinygemm: can run" in shown
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(3000)))
    rc = main(["eval", str(out), "--ppl", str(text), "--seqlen", "32", "--windows", "4",
               "--json", str(tmp_path / "e.json"), "--no-progress"])
    assert rc == 0
    e = json.loads((tmp_path / "e.json").read_text())
    assert e["seqlen"] == 32 and e["windows"] == 4 and e["tokens"] > 0
    assert e["ppl"][str(text)] > 1.0
    rc = main(["generate", str(out), "--prompt", "word1 word2", "--max-new-tokens", "4",
               "--json", str(tmp_path / "g.json")])
    assert rc == 0
    assert json.loads((tmp_path / "g.json").read_text())["new_tokens"] <= 4


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["quantize", "/nonexistent/model-folder", "--method", "rtn", "--out", "X"], "model folder not found"),
        (["eval", "/nonexistent/ckpt", "--ppl", "pydoc"], "not"),
        (["inspect", "/nonexistent/ckpt"], "does not exist"),
        (["quantize", "--recipe", "no-such-recipe"], "unknown recipe"),
        # each refused before the (absent) model is looked for: internal errors or runs before
        (["generate", "no-model", "--prompt", "hi", "--max-new-tokens", "-5"], "--max-new-tokens -5"),
        (["generate", "no-model", "--prompt", "hi", "--temperature", "nan"], "temperature=nan"),
        (["generate", "no-model", "--prompt", "hi", "--backend", "nope"], "unknown kernel backend 'nope'"),
        (["generate", "no-model", "--prompt", "hi", "--draft", "ngram", "--k", "-1"], "--k -1"),
        (["bench-specdec", "no-model", "--draft", "ngram", "--threads", "-1"], "--threads -1"),
        (["bench-specdec", "no-model", "--draft", "ngram", "--max-new-tokens", "0"], "--max-new-tokens 0"),
        (["train-draft", "no-model", "--out", "/proc/no-such/head"], "--out /proc/no-such/head cannot be written"),
        (["quantize", "no-model", "--method", "rtn", "--out", "/proc/no-such/q"], "cannot be written"),
        (["generate", "no-model", "--prompt", "hi", "--json", "/proc/no-such/g.json"], "--json /proc/no-such/g.json"),
        # argparse's own errors: one line with the fix, not the usage block (before: 30 lines)
        (["quantize", "no-model", "--bits", "5"], "argument --bits: invalid choice: 5"),
        (["quantize", "no-model", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["no-such-command"], "invalid choice: 'no-such-command'"),
    ],
)
def test_bad_input_exit_code_2_one_line(argv, needle, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert err.count("\n") == 0 and err.startswith("quantspec") and "error:" in err and needle in err, err
    assert "Fix:" in err


def test_impossible_scheme_caught_before_work(tiny, tmp_path, capsys):
    rc = main(["quantize", str(tiny), "--method", "rtn", "--bits", "3", "--format", "awq",
               "--out", str(tmp_path / "o")])
    assert rc == 2
    assert "awq" in capsys.readouterr().err.lower()
    assert not (tmp_path / "o").exists()


def test_existing_out_needs_overwrite(tiny, tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    rc = main(["quantize", str(tiny), "--method", "rtn", "--out", str(out), "--group-size", "32"])
    assert rc == 2 and "--overwrite" in capsys.readouterr().err
    rc = main(["quantize", str(tiny), "--method", "rtn", "--out", str(out), "--group-size", "32",
               "--overwrite", "--no-progress"])
    assert rc == 0 and (out / "config.json").is_file()


def test_generate_with_ngram_draft_matches_plain_greedy(tiny, tmp_path):
    plain, spec = tmp_path / "plain.json", tmp_path / "spec.json"
    prompt = "word1 word2 word3 word1 word2 word3 word1 word2"
    assert main(["generate", str(tiny), "--prompt", prompt, "--max-new-tokens", "12", "--json", str(plain)]) == 0
    assert main(["generate", str(tiny), "--prompt", prompt, "--max-new-tokens", "12",
                 "--draft", "ngram", "--k", "3", "--json", str(spec)]) == 0
    a, b = json.loads(plain.read_text()), json.loads(spec.read_text())
    assert a["text"] == b["text"]
    assert b["specdec"]["target_calls"] >= 1


def test_quantize_compare_table(tiny, tmp_path, capsys):
    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"word{i % 37}" for i in range(3000)))
    rc = main(["quantize", str(tiny), "--method", "rtn", "--group-size", "32", "--out", str(tmp_path / "o"),
               "--compare", "--compare-data", str(text), "--compare-windows", "2", "--no-progress",
               "--json", str(tmp_path / "q.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "dense fp32" in out and "quantized" in out
    table = json.loads((tmp_path / "q.json").read_text())["compare"]
    rows = table["rows"]
    assert rows["dense fp32"]["ppl"] > 1 and all(r["decode_tok_s"] > 0 for r in rows.values())
    assert all(r["static_tok_s"] > 0 for r in rows.values())  # a llama: the static decoder runs it
    assert "static tok/s" in out
    q = next(v for k, v in rows.items() if k.startswith("quantized"))
    assert q["size_mb"] < rows["dense fp32"]["size_mb"]


def test_awq_flags_reach_the_recipe():
    from quantspec.cli.main import build_parser
    from quantspec.cli.quantize import recipe_from_args

    parse = build_parser().parse_args
    base = recipe_from_args(parse(["quantize", "--recipe", "awq-w4g128"]))
    assert base.awq.clip is None and base.awq.duo_scaling == "both" and base.awq.search_dtype == "float32"
    assert base.awq.clip_min_gain == 0.3
    r = recipe_from_args(parse(["quantize", "--recipe", "awq-w4g128", "--clip", "--duo-scaling", "off",
                                "--save-scales", "s.safetensors", "--awq-search-dtype", "bfloat16",
                                "--clip-min-gain", "0"]))
    assert r.awq.clip is True and r.awq.duo_scaling is False and r.awq.save_scales == "s.safetensors"
    assert r.awq.search_dtype == "bfloat16" and r.awq.clip_min_gain == 0.0
    assert r.scheme == base.scheme and r.awq.grid == base.awq.grid


def test_asymmetric_flag_reaches_gptq_options_and_is_refused_without_gptq():
    from quantspec.cli.main import build_parser
    from quantspec.cli.quantize import recipe_from_args

    parse = build_parser().parse_args
    assert recipe_from_args(parse(["quantize", "--method", "gptq"])).gptq.asymmetric is False
    assert recipe_from_args(parse(["quantize", "--method", "gptq", "--scheme", "nvfp4", "--asymmetric-calibration"])).gptq.asymmetric is True
    assert recipe_from_args(parse(["quantize", "--method", "awq+gptq", "--asymmetric-calibration"])).gptq.asymmetric is True
    with pytest.raises(QuantspecError, match="--asymmetric-calibration is a GPTQ setting"):
        recipe_from_args(parse(["quantize", "--method", "rtn", "--asymmetric-calibration"]))


def test_no_act_order_alone_turns_static_groups_off_and_experts_flag_reaches_the_recipe():
    """``--no-act-order`` on GPTQ's default scheme (act-order with static groups) used to fail
    ("static_groups only has a meaning together with act_order"); an explicit
    ``--static-groups`` with it still fails, as asked."""
    from quantspec.cli.main import build_parser
    from quantspec.cli.quantize import recipe_from_args
    from quantspec.errors import QuantspecError

    parse = build_parser().parse_args
    r = recipe_from_args(parse(["quantize", "--method", "gptq", "--no-act-order", "--calib-experts", "routed"]))
    assert not r.scheme.act_order and not r.scheme.static_groups and r.calibration.experts == "routed"
    with pytest.raises(QuantspecError, match="static_groups"):
        recipe_from_args(parse(["quantize", "--method", "gptq", "--no-act-order", "--static-groups"]))


def test_quantspecs_warnings_print_as_one_line():
    """A warning raised from quantspec's code is shown as ``quantspec: warning: ...`` under the CLI;
    with --debug, and for other packages, in Python's form with the file and line. Only the
    display changes: a caller recording warnings (pytest.warns) still gets them."""
    import warnings
    from pathlib import Path

    from quantspec.cli.main import one_line_warnings
    from quantspec.quant import job

    ours, theirs = str(Path(job.__file__)), str(Path(pytest.__file__))
    python_form = warnings.formatwarning("m", UserWarning, ours, 10)
    for debug in (False, True):
        with one_line_warnings(debug):
            shown = warnings.formatwarning("gptq.forward_dtype=bfloat16 on cpu ...", UserWarning, ours, 10)
            other = warnings.formatwarning("a note of another package", UserWarning, theirs, 20)
        if debug:  # Python's form: the file, the line number, then the source line
            assert shown.startswith(f"{ours}:10: UserWarning: gptq.forward_dtype=bfloat16 on cpu ...\n")
        else:
            assert shown == "quantspec: warning: gptq.forward_dtype=bfloat16 on cpu ...\n"
        assert other.startswith(f"{theirs}:20: UserWarning: a note of another package\n")
    assert warnings.formatwarning("m", UserWarning, ours, 10) == python_form  # restored
    with pytest.warns(UserWarning, match="recorded"), one_line_warnings(False):
        warnings.warn_explicit("recorded", UserWarning, ours, 10)
