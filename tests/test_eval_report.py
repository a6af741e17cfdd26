"""The sweep report's picture and text: no empty panel (the text says why one is left out),
labels that do not overlap when points crowd, and report files redrawn from report.json alone."""

from __future__ import annotations

import itertools
import json

import pytest
from matplotlib.figure import Figure
from matplotlib.text import Text

from quantspec.cli.main import main as cli_main
from quantspec.eval.report import render_report, write_report
from quantspec.eval.report_plot import plot_notes, plot_report
from quantspec.eval.sweep import SweepConfig


@pytest.fixture
def saved_figures(monkeypatch):
    """Every Figure saved while the test runs (whatever function drew it)."""
    saved = []
    original = Figure.savefig

    def keep(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    return saved


def point_record(name: str, method: str | None, bits: int, ppl: float | None, size_mb: float | None) -> dict:
    return {"name": name, "status": "ok", "seconds": 1.0, "quantize": None, "bench": None, "tasks": None,
            "point": {"method": method, "bits": bits, "group_size": 128, "format": None if method is None else "gptq",
                      "extra_args": []},
            "eval": None if ppl is None else {"ppl": {"wikitext2": ppl}, "seqlen": 512, "windows": 20, "tokens": 10240},
            "size_mb": size_mb}


def sweep_cfg(speed: bool) -> SweepConfig:
    """A sweep config as the report reads it (also used by the browser test)."""
    return SweepConfig.from_dict({"model": "tiny", "grid": {"methods": ["rtn"], "bits": [4], "group_sizes": [128],
                                                            "formats": ["gptq"]},
                                  "eval": {"ppl": ["wikitext2"], "seqlen": 512, "windows": 20, "speed": speed}})


def _row(name: str, ppl: float | None, tps: float | None, size: float | None, method: str = "rtn") -> dict:
    return {"name": name, "method": method, "bits": 4, "group": 128, "format": "gptq", "status": "ok",
            "size_mb": size, "ppl": ppl, "acc": None, "tokens_per_s": tps, "speedup": None, "ppl_delta": None}


def _label_boxes(fig) -> dict:
    """axes -> [(text, box)] of every text drawn inside it, measured by the renderer."""
    renderer = fig.canvas.get_renderer()
    return {ax: [(t.get_text(), Text.get_window_extent(t, renderer)) for t in ax.texts] for ax in fig.axes}


def _assert_readable(fig, rows: list[dict]) -> None:
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    boxes = _label_boxes(fig)
    for labels in boxes.values():
        for (ta, a), (tb, b) in itertools.combinations(labels, 2):
            assert not a.overlaps(b), f"labels {ta!r} and {tb!r} overlap: {a} / {b}"
    for ax, labels in boxes.items():
        frame = ax.get_window_extent(renderer)
        for text, box in labels:
            assert frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1), f"{text!r} leaves its axes"
            for (x, y) in ax.transData.transform([(c.get_offsets()[0]) for c in ax.collections]):
                assert not box.contains(x, y), f"{text!r} covers a point"
    shown = {t.get_text() for ax in fig.axes for t in ax.texts} | {t.get_text() for t in fig.texts}
    for r in rows:  # the figure writes compressed-tensors as ct
        name = r["name"].replace("compressed-tensors", "ct")
        assert any(name in s for s in shown), f"{name} is named nowhere in the figure"


def test_no_speed_data_draws_no_empty_panel_and_says_why(tmp_path, saved_figures):
    records = [point_record("dense", None, 16, 20.0, 270.0), point_record("rtn-w4g128-gptq", "rtn", 4, 23.0, 95.0),
               point_record("rtn-w3g128-gptq", "rtn", 3, 40.0, 80.0)]
    write_report(sweep_cfg(speed=False), records, tmp_path)
    assert len(saved_figures) == 1
    fig = saved_figures[0]
    assert len(fig.axes) == 1, [ax.get_xlabel() for ax in fig.axes]
    assert "size" in fig.axes[0].get_xlabel()
    assert len(fig.axes[0].collections) == 3  # every point is drawn on the one panel
    md = (tmp_path / "report.md").read_text()
    why = "decode speed plot is left out: no point has decode tokens/s (speed was not measured"
    assert why in md and "eval.speed = false" in md
    assert why in (tmp_path / "report.html").read_text()


def test_crowded_points_get_labels_that_do_not_overlap(tmp_path, saved_figures):
    names = ["rtn-w4g128-gptq", "gptq-w4g128-gptq", "awq-w4g128-gptq", "rtn-w4g64-gptq", "gptq-w4g64-gptq",
             "awq-w4g64-gptq", "smoothquant-w8gpc-compressed-tensors", "rtn-w8gpc-gptq"]
    rows = [_row("dense", 29.19, 40.0, 270.0, method="dense")]
    rows += [_row(n, 44.1 + 0.1 * i, 61.0 + 0.2 * i, 108.8 + 0.05 * i) for i, n in enumerate(names)]
    plot_report(rows, tmp_path / "report.png")
    assert len(saved_figures) == 1 and len(saved_figures[0].axes) == 2
    _assert_readable(saved_figures[0], rows)


def test_labels_of_the_quality_sweep_points_do_not_overlap(tmp_path, saved_figures):
    """The points of benchmarks/results/quality-smollm2 (size MB, ppl), where two pairs nearly coincide."""
    points = {"rtn-w8gpc-gptq": (156.4, 29.380), "rtn-w4g128-gptq": (108.8, 44.408), "rtn-w3g128-gptq": (96.0, 213.196),
              "gptq-w4g128-gptq": (108.8, 44.106), "gptq-w3g128-gptq": (96.0, 121.621),
              "smoothquant-w8gpc-compressed-tensors": (155.7, 29.616)}
    rows = [_row(n, ppl, None, size) for n, (size, ppl) in points.items()]
    plot_report(rows, tmp_path / "report.png")
    _assert_readable(saved_figures[0], rows)


def test_names_that_fit_nowhere_become_numbers_with_a_key(tmp_path, saved_figures):
    rows = [_row(f"method{i:02d}-w4g128-a-rather-long-point-name", 30.0 + 0.01 * i, 50.0, 100.0 + 0.01 * i)
            for i in range(40)]
    plot_report(rows, tmp_path / "report.png")
    fig = saved_figures[0]
    _assert_readable(fig, rows)
    key = "\n".join(t.get_text() for t in fig.texts)
    numbered = {t.get_text() for ax in fig.axes for t in ax.texts if t.get_text().isdigit()}
    assert numbered, "40 long names in one spot should not all fit"
    for n in numbered:
        assert f"{n} = method{int(n) - 1:02d}-" in key


def test_no_point_to_draw_writes_no_picture(tmp_path):
    (tmp_path / "report.png").write_bytes(b"stale")  # from an earlier render
    rows = [_row("dense", None, None, None, method="dense"), {**_row("rtn-w4g128-gptq", None, None, None),
                                                              "status": "failed", "error": "boom"}]
    assert plot_report(rows, tmp_path / "report.png") is None
    assert not (tmp_path / "report.png").exists()
    notes = plot_notes(rows)
    assert len(notes) == 2 and all("left out" in n and "perplexity" in n for n in notes)


def test_points_a_panel_leaves_off_are_named():
    rows = [_row("dense", 20.0, 100.0, None, method="dense"), _row("rtn-w4g128-gptq", 23.0, 120.0, 95.0)]
    assert plot_notes(rows) == ["Not in the quality vs size plot: dense (no size)."]


def test_report_is_redrawn_from_its_json_alone(tmp_path, capsys):
    records = [point_record("dense", None, 16, 20.0, 270.0), point_record("rtn-w4g128-gptq", "rtn", 4, 23.0, 95.0)]
    first = tmp_path / "first"
    first.mkdir()
    write_report(sweep_cfg(speed=False), records, first)
    again = tmp_path / "again"
    again.mkdir()
    (again / "report.json").write_text((first / "report.json").read_text())
    assert cli_main(["report", str(again)]) == 0
    for name in ("report.md", "report.html", "report.png"):
        assert (again / name).read_bytes() == (first / name).read_bytes(), name
    assert json.loads((again / "report.json").read_text()) == json.loads((first / "report.json").read_text())
    assert render_report(json.loads((first / "report.json").read_text()), again) == again / "report.png"


def test_report_command_refuses_a_file_that_is_not_a_report(tmp_path, capsys):
    (tmp_path / "report.json").write_text(json.dumps({"rows": []}))
    assert cli_main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a sweep report" in err and len(err.strip().splitlines()) == 1
