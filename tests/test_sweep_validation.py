"""Bad sweep YAMLs and hand-edited report.json files are refused up front, as one-line
QuantspecErrors naming the field, before any point runs or any report file is written."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from test_eval_report import point_record, sweep_cfg
from test_eval_sweep import FakeRunner, FakeTimer

from quantspec.cli.main import main as cli_main
from quantspec.errors import QuantspecError
from quantspec.eval.report import load_report, render_report, write_report
from quantspec.eval.sweep import SweepConfig, run_sweep

REPO = Path(__file__).resolve().parents[1]
GRID = {"methods": ["rtn"], "bits": [4], "group_sizes": [128], "formats": ["gptq"]}


def _data(**kw) -> dict:
    data = {"model": "tiny", "grid": dict(GRID), "eval": {"ppl": ["wikitext2"], "seqlen": 512, "windows": 20}}
    data.update(kw)
    return data


def _refused(data: dict, *words: str) -> str:
    """The one-line QuantspecError that loading ``data`` gives; it names every one of ``words``."""
    with pytest.raises(QuantspecError) as info:
        SweepConfig.from_dict(data)
    msg = str(info.value)
    assert "\n" not in msg and info.value.fix, msg
    for w in words:
        assert w in msg, f"{w!r} not in {msg!r}"
    return msg


# ---------------------------------------------------------------- 1. every point and setting, up front


@pytest.mark.parametrize("point, words", [
    ({"method": "rtn", "bits": 5, "group_size": 128, "format": "gptq"}, ("rtn-w5g128-gptq", "bits")),
    ({"method": "foo", "bits": 4, "group_size": 128, "format": "gptq"}, ("foo-w4g128-gptq", "method")),
    ({"method": "rtn", "bits": 4, "group_size": 48, "format": "gptq"}, ("rtn-w4g48-gptq", "group_size")),
    ({"method": "rtn", "bits": 3, "group_size": 128, "format": "awq"}, ("rtn-w3g128-awq", "4-bit")),
    ({"method": "smoothquant", "bits": 4, "group_size": 128, "format": "gptq"}, ("smoothquant-w4g128-gptq",)),
    ({"method": "rtn", "bits": 4, "group_size": 128, "format": "gptq", "extra_args": ["--bogus"]},
     ("rtn-w4g128-gptq", "--bogus")),
])
def test_an_impossible_point_is_refused_when_the_sweep_loads(point, words):
    _refused(_data(grid={"methods": []}, points=[point]), "point", *words)


def test_a_point_the_quantize_command_would_not_make_is_refused():
    """quantize_args come last on the quantize command line: a --bits there would override every point's."""
    _refused(_data(quantize_args=["--bits", "8"]), "rtn-w4g128-gptq", "rtn-w8g128-gptq")
    _refused(_data(grid={"methods": []}, points=[{"method": "smoothquant", "bits": 8, "group_size": 128,
                                                  "format": "compressed-tensors"}]), "smoothquant-w8g128-compressed-tensors")


def test_a_point_given_twice_with_other_extra_args_is_refused():
    point = {"method": "rtn", "bits": 4, "group_size": 128, "format": "gptq"}
    assert len(SweepConfig.from_dict(_data(points=[point])).all_points()) == 2  # the same point twice: once
    _refused(_data(points=[{**point, "extra_args": ["--seed", 1]}]), "rtn-w4g128-gptq", "twice", "--seed")


def test_every_point_command_resolves_to_its_own_recipe():
    """The smoothquant point's command (--w8a8) is accepted by quantize and makes the point's scheme."""
    from quantspec.eval.sweep_check import quantize_recipe

    cfg = SweepConfig.from_yaml(REPO / "recipes" / "sweep-default.yaml")
    for point in cfg.all_points()[1:]:
        recipe = quantize_recipe(point, cfg)
        assert (recipe.method, recipe.scheme.bits, recipe.scheme.group_size, recipe.format) == (
            point.method, point.bits, point.group_size, point.format)
        assert recipe.calibration.samples == 32  # quantize_args reach it


def test_an_impossible_grid_point_is_refused_when_the_sweep_loads():
    _refused(_data(grid={**GRID, "bits": [4, 5]}), "rtn-w5g128-gptq", "bits")


@pytest.mark.parametrize("change, words", [
    ({"model": "/nonexistent"}, ("model", "/nonexistent")),
    ({"dtype": "foo"}, ("dtype", "foo")),
    ({"device": "tpu"}, ("device",)),
    ({"eval": {"ppl": ["wikitext2"], "seqlen": 0}}, ("eval.seqlen",)),
    ({"eval": {"ppl": ["wikitext2"], "windows": -1}}, ("eval.windows",)),
    ({"eval": {"ppl": ["nosuchdata"]}}, ("eval.ppl", "nosuchdata")),
    ({"eval": {"ppl": ["wikitext2"], "limit": 0}}, ("eval.limit",)),
    ({"eval": {"ppl": ["wikitext2"], "include_path": "/nonexistent/tasks"}}, ("eval.include_path",)),
    ({"quantize_args": ["--bogus"]}, ("quantize_args", "--bogus")),
    ({"quantize_args": ["--calib-samples", "many"]}, ("quantize_args", "many")),
    ({"timeout_s": -5}, ("timeout_s", "-5")),
    ({"speed": {"new_tokens": 0}}, ("speed", "new_tokens")),
    ({"speed": {"batch_sizes": []}}, ("speed", "batch")),
])
def test_a_bad_sweep_wide_setting_is_refused_when_the_sweep_loads(change, words):
    _refused(_data(**change), *words)


def test_a_model_override_is_checked_too():
    from dataclasses import replace

    cfg = SweepConfig.from_dict(_data())
    with pytest.raises(QuantspecError, match="/nonexistent"):
        replace(cfg, model="/nonexistent")


def test_good_sweeps_still_load(tmp_path):
    for name in ("sweep-default.yaml", "sweep-quality.yaml"):
        SweepConfig.from_yaml(REPO / "recipes" / name)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    text = tmp_path / "t.txt"
    text.write_text("some text")
    cfg = SweepConfig.from_dict(_data(model=str(model), eval={"ppl": ["c4-bundled-heldout", str(text)], "windows": 0},
                                      quantize_args=["--calib", "c4-bundled", "--calib-samples", 32]))
    assert cfg.quantize_args == ("--calib", "c4-bundled", "--calib-samples", "32")
    assert SweepConfig.from_dict(_data(model="HuggingFaceTB/SmolLM2-135M")).model == "HuggingFaceTB/SmolLM2-135M"


def test_the_cli_refuses_a_bad_sweep_before_running_anything(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: tiny\ndense: false\ngrid: {methods: [rtn], bits: [5], group_sizes: [128], formats: [gptq]}\n"
                   "eval: {ppl: [wikitext2], speed: false}\n")
    out = tmp_path / "out"
    assert cli_main(["sweep", str(bad), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rtn-w5g128-gptq" in err
    assert not out.exists()  # nothing started, nothing written


# ---------------------------------------------------------------- 2. every field type-checked


@pytest.mark.parametrize("change, words", [
    ({"grid": {**GRID, "methods": "rtn"}}, ("grid.methods", "list")),
    ({"grid": {**GRID, "bits": ["four"]}}, ("grid.bits", "four")),
    ({"grid": {**GRID, "bits": [True]}}, ("grid.bits",)),
    ({"grid": {**GRID, "group_sizes": [128.0]}}, ("grid.group_sizes",)),
    ({"grid": ["rtn"]}, ("grid", "mapping")),
    ({"dense": "no"}, ("dense", "no")),
    ({"dense": 1}, ("dense",)),
    ({"model": 5}, ("model",)),
    ({"timeout_s": "10"}, ("timeout_s",)),
    ({"timeout_s": True}, ("timeout_s",)),
    ({"quantize_args": "--calib c4"}, ("quantize_args", "list")),
    ({"quantize_args": [["--calib"]]}, ("quantize_args",)),
    ({"points": {"method": "rtn"}}, ("points", "list")),
    ({"points": ["rtn"]}, ("points[0]", "mapping")),
    ({"points": [{"method": "rtn", "bits": "4", "group_size": 128, "format": "gptq"}]}, ("points[0].bits",)),
    ({"points": [{"method": "rtn", "bits": 4, "group_size": 128, "format": "gptq", "extra_args": "--seed 1"}]},
     ("points[0].extra_args",)),
    ({"eval": {"ppl": "wikitext2"}}, ("eval.ppl", "list")),
    ({"eval": {"speed": "yes"}}, ("eval.speed",)),
    ({"eval": {"tasks": "arc_easy"}}, ("eval.tasks",)),
    ({"eval": {"seqlen": "512"}}, ("eval.seqlen",)),
    ({"speed": {"new_tokens": 0}}, ("new_tokens",)),
    ({"speed": {"repeats": "3"}}, ("speed.repeats",)),
    ({"speed": {"prompt_lengths": 128}}, ("speed.prompt_lengths",)),
    ({"serve": {"num_prompts": "32"}}, ("serve.num_prompts",)),
])
def test_a_mistyped_field_is_refused_not_misread(change, words):
    _refused(_data(**change), *words)


def test_a_mistyped_grid_runs_no_point(tmp_path):
    """Before: grid methods "rtn" ran points r, t and n; bits ["four"] crashed after the dense point."""
    runner = FakeRunner()
    for change in ({"grid": {**GRID, "methods": "rtn"}}, {"grid": {**GRID, "bits": ["four"]}}):
        with pytest.raises(QuantspecError):
            run_sweep(SweepConfig.from_dict(_data(**change)), tmp_path / "out", runner=runner, timer=FakeTimer())
    assert runner.calls == [] and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 3. report.json read strictly, written whole

REPORT_FILES = ("report.md", "report.png", "report.html")


@pytest.fixture
def saved(tmp_path) -> dict:
    """The report.json of a small sweep, as `quantspec sweep` writes it."""
    first = tmp_path / "first"
    first.mkdir()
    records = [point_record("dense", None, 16, 20.0, 270.0), point_record("rtn-w4g128-gptq", "rtn", 4, 23.0, 95.0)]
    write_report(sweep_cfg(speed=False), records, first)
    return json.loads((first / "report.json").read_text())


def _edit(report: dict, path: str, value) -> dict:
    """A copy of ``report`` with ``path`` ("rows.0.ppl") set to ``value`` (a missing ``value``: deleted)."""
    report = copy.deepcopy(report)
    *head, last = path.split(".")
    node = report
    for key in head:
        node = node[int(key)] if isinstance(node, list) else node[key]
    key = int(last) if isinstance(node, list) else last
    if value is _DELETE:
        del node[key]
    else:
        node[key] = value
    return report


_DELETE = object()


@pytest.mark.parametrize("path, value, words", [
    ("rows", "oops", ("rows", "list")),
    ("rows.0", "oops", ("rows[0]",)),
    ("rows.1.status", _DELETE, ("rows[1].status", "missing")),
    ("rows.1.ppl", "abc", ("rows[1].ppl", "number")),
    ("rows.1.ppl", _DELETE, ("rows[1].ppl",)),
    ("rows.1.bits", 4.5, ("rows[1].bits",)),
    ("rows.1.name", None, ("rows[1].name",)),
    ("protocol", None, ("protocol", "mapping")),
    ("protocol.perplexity", 3, ("protocol.perplexity",)),
    ("protocol.speed", _DELETE, ("protocol.speed",)),
    ("machine", "x", ("machine", "mapping")),
    ("machine.gpus", "H100", ("machine.gpus",)),
    ("versions", "x", ("versions",)),
    ("created", 5, ("created",)),
    ("model", ["m"], ("model",)),
    ("sweep", "x", ("sweep",)),
])
def test_a_hand_edited_report_json_is_refused_naming_the_field(tmp_path, capsys, saved, path, value, words):
    folder = tmp_path / "edited"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps(_edit(saved, path, value)))
    assert cli_main(["report", str(folder)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("quantspec: error:"), err
    for w in words:
        assert w in err, f"{w!r} not in {err!r}"
    assert sorted(p.name for p in folder.iterdir()) == ["report.json"]  # nothing written


def test_a_failed_row_needs_no_numbers(tmp_path, saved):
    """A failed row carries its error, not the measurements (as report_rows writes it)."""
    row = {k: saved["rows"][1][k] for k in ("name", "method", "bits", "group", "format")}
    report = {**saved, "rows": [saved["rows"][0], {**row, "status": "failed", "error": "boom"}]}
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert load_report(tmp_path)["rows"][1]["error"] == "boom"


def test_a_render_that_fails_leaves_the_previous_report_files(tmp_path, saved, monkeypatch):
    """A failure after validation (here: the HTML page) writes no file, and keeps the files of
    the previous render as they were (no new report.png beside an old report.md)."""
    from quantspec.eval import report_html

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "report.json").write_text(json.dumps(saved))
    old = tmp_path / "old"
    old.mkdir()
    (old / "report.json").write_text(json.dumps(saved))
    for name in REPORT_FILES:
        (old / name).write_bytes(b"previous " + name.encode())

    def boom(*args, **kwargs):
        raise RuntimeError("the page failed")

    monkeypatch.setattr(report_html, "report_html", boom)
    for folder in (fresh, old):
        with pytest.raises(RuntimeError, match="the page failed"):
            render_report(load_report(folder), folder)
    assert sorted(p.name for p in fresh.iterdir()) == ["report.json"]
    assert sorted(p.name for p in old.iterdir()) == sorted(["report.json", *REPORT_FILES])
    for name in REPORT_FILES:
        assert (old / name).read_bytes() == b"previous " + name.encode(), name
