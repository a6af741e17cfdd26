"""Data sources and calibration sampling (offline; tiny tokenizer; shared data folder when present)."""

from __future__ import annotations

import fnmatch
import hashlib
import json
import tomllib
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_model, make_tiny_tokenizer

from quantspec.data import calibration_samples, load_text
from quantspec.data.sources import PYDOC_LABEL
from quantspec.errors import QuantspecError


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("QUANTSPEC_DATA", raising=False)
    monkeypatch.setenv("QUANTSPEC_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok():
    return make_tiny_tokenizer()


def test_pydoc_builtin(offline):
    src = load_text("pydoc")
    assert src.label == PYDOC_LABEL and src.documents is None
    assert len(src.text) > 100_000 and "for" in src.text


def test_txt_and_jsonl_files(offline, tmp_path):
    txt = tmp_path / "a.txt"
    txt.write_text("hello world\nsecond line\n", encoding="utf-8")
    assert load_text(str(txt)).text == "hello world\nsecond line\n"
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["one doc", "two doc"])) + "\n")
    src = load_text(str(jl))
    assert src.documents == ["one doc", "two doc"] and src.text == "one doc\n\ntwo doc"


@pytest.mark.parametrize(
    "content, needle",
    [(b"", "empty"), (b"   \n", "empty"), (b"\xff\xfe\x00bad", "UTF-8"), (b'{"body": "x"}\n', '"text"'),
     (b"not json\n", "JSON")],
)
def test_bad_files(offline, tmp_path, content, needle):
    path = tmp_path / ("f.jsonl" if b"{" in content or b"json" in content else "f.txt")
    path.write_bytes(content)
    with pytest.raises(QuantspecError, match=needle) as err:
        load_text(str(path))
    assert err.value.fix


def test_missing_file_and_unknown_name(offline, tmp_path):
    with pytest.raises(QuantspecError, match="not found"):
        load_text(str(tmp_path / "nope.txt"))
    with pytest.raises(QuantspecError, match="unknown data source"):
        load_text("no-such-dataset")


def test_named_dataset_offline_without_local_copy_fails_fast(offline):
    with pytest.raises(QuantspecError, match="QUANTSPEC_DATA") as err:
        load_text("wikitext2")
    assert "c4-bundled" in err.value.fix


def test_named_datasets_from_local_copies(offline, monkeypatch, data_dir):
    monkeypatch.setenv("QUANTSPEC_DATA", str(data_dir))
    wiki = load_text("wikitext2")
    assert wiki.label == "wikitext2" and wiki.documents is None and wiki.text.startswith("\n\n = Robert Boulter =")
    c4 = load_text("c4")
    assert c4.label == "c4" and len(c4.documents) == 2000 and c4.text == "\n\n".join(c4.documents)


def test_calibration_plain_text_deterministic(offline, tok):
    a = calibration_samples(tok, "pydoc", n=6, seqlen=32, seed=3)
    b = calibration_samples(tok, "pydoc", n=6, seqlen=32, seed=3)
    c = calibration_samples(tok, "pydoc", n=6, seqlen=32, seed=4)
    assert a.shape == (6, 32) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    ids = tok(load_text("pydoc").text)["input_ids"]
    row = a[0].tolist()  # each window is a contiguous slice of the tokenized text
    assert any(ids[i : i + 32] == row for i in range(len(ids) - 31))


def test_python_stdlib_is_code_one_document_per_file(offline):
    import sysconfig

    src = load_text("python-stdlib")
    assert src.label.startswith("python-stdlib ") and len(src.documents) > 100
    assert src.text == "\n\n".join(src.documents)
    root = Path(sysconfig.get_paths()["stdlib"])
    assert (root / "textwrap.py").read_text(encoding="utf-8") in src.documents
    suite = root / "test" / "test_textwrap.py"  # test suites are left out (absent in some installs)
    assert not suite.is_file() or suite.read_text(encoding="utf-8") not in src.documents


def test_calibration_mixture_splits_samples_over_its_sources(offline, tmp_path, tok):
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"document {i} " + "word " * 60}) for i in range(8)))
    mixed = calibration_samples(tok, f"pydoc+{jl}", n=5, seqlen=24, seed=2)
    assert mixed.shape == (5, 24)
    assert torch.equal(mixed[:3], calibration_samples(tok, "pydoc", n=3, seqlen=24, seed=2))
    assert torch.equal(mixed[3:], calibration_samples(tok, str(jl), n=2, seqlen=24, seed=2))
    for bad in ("pydoc+", f"pydoc+{jl}+pydoc"):
        with pytest.raises(QuantspecError, match="mixture") as err:
            calibration_samples(tok, bad, n=2, seqlen=24)
        assert "c4+python-stdlib" in err.value.fix
    plus = tmp_path / "a+b.txt"  # a file whose name holds + is a file, not a mixture
    plus.write_text("word " * 400, encoding="utf-8")
    assert calibration_samples(tok, str(plus), n=2, seqlen=24).shape == (2, 24)


def test_calibration_documents(offline, tmp_path, tok):
    long_docs = [f"document {i} " + "word " * 60 for i in range(5)]
    short_docs = ["tiny"] * 20
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in long_docs + short_docs))
    out = calibration_samples(tok, str(jl), n=4, seqlen=24, seed=0)
    assert out.shape == (4, 24)
    encoded = [tok(d)["input_ids"] for d in long_docs]
    for row in out.tolist():  # every sample is a window of one long document
        assert any(any(e[i : i + 24] == row for i in range(len(e) - 23)) for e in encoded)
    # more samples than long documents: the rest come from the concatenation
    assert calibration_samples(tok, str(jl), n=8, seqlen=24, seed=0).shape == (8, 24)


def test_documents_outside_draw(offline, tmp_path, tok):
    from quantspec.data.calibration import documents_outside_draw

    docs = [f"document {i} " + f"w{i} word{i} " * 30 if i % 3 else "tiny" for i in range(40)]
    jl = tmp_path / "docs.jsonl"
    jl.write_text("\n".join(json.dumps({"text": t}) for t in docs))
    encoded = [tok(d)["input_ids"] for d in docs]
    lengths = [len(e) for e in encoded]
    for seed in (0, 1, 2):
        out = calibration_samples(tok, str(jl), n=5, seqlen=24, seed=seed)
        outside = documents_outside_draw(lengths, 5, 24, seed)
        sampled = {j for row in out.tolist() for j, e in enumerate(encoded)
                   if any(e[i : i + 24] == row for i in range(len(e) - 23))}
        assert len(sampled) == 5 and not sampled & set(outside)
        long_docs = sum(n >= 24 for n in lengths)
        assert len([j for j in outside if lengths[j] >= 24]) == long_docs - 5 and outside == sorted(outside)
    assert documents_outside_draw(lengths, 100, 24, 0) == []  # too few long documents: all are read


def test_calibration_too_little_data(offline, tmp_path, tok):
    txt = tmp_path / "small.txt"
    txt.write_text("a short text " * 5)
    with pytest.raises(QuantspecError, match="tokens") as err:
        calibration_samples(tok, str(txt), n=4, seqlen=64)
    assert "lower" in err.value.fix


# The C4 sample shipped in the package (quantspec/data/bundled.py): offline calibration and
# perplexity. New modules are imported inside the tests, so that this file also runs on code
# from before the sample (to show what the old fallback picked).

def _ids_text(tok, docs: list[str]) -> str:
    """Each document's token ids as ",1,2,3," lines, for finding a window by substring search."""
    return "\n".join("," + ",".join(map(str, ids)) + "," for ids in tok(docs)["input_ids"])


def _window_in(row: list[int], ids_text: str) -> bool:
    """Whether ``row`` is a contiguous slice of one document of ``ids_text``."""
    return "," + ",".join(map(str, row)) + "," in ids_text


def test_bundled_sample_loads_offline(offline):
    from quantspec.data import bundled

    calib, held = load_text("c4-bundled"), load_text("c4-bundled-heldout")
    assert (len(calib.documents), len(held.documents)) == (300, 100)
    assert calib.label == "c4 (bundled 400-doc sample: calibration docs 0-299)"
    assert held.label == "c4 (bundled 400-doc sample: held-out docs 300-399)"
    assert calib.text == "\n\n".join(calib.documents) and all(d.strip() for d in calib.documents)
    assert not set(calib.documents) & set(held.documents)
    raw = bundled.read_sample_bytes()
    assert hashlib.sha256(raw).hexdigest() == bundled.SAMPLE_SHA256
    assert [json.loads(line)["text"] for line in raw.decode("utf-8").splitlines()] == calib.documents + held.documents


def test_bundled_sample_is_the_start_of_the_local_copy(offline, monkeypatch, data_dir):
    from quantspec.data import bundled

    monkeypatch.setenv("QUANTSPEC_DATA", str(data_dir))
    local = data_dir / "c4" / bundled.SOURCE_FILE
    assert hashlib.sha256(local.read_bytes()).hexdigest() == bundled.SOURCE_SHA256
    docs = load_text("c4").documents
    assert load_text("c4-bundled").documents + load_text("c4-bundled-heldout").documents == docs[:400]


def test_bundled_sample_is_package_data():
    from importlib import resources

    from quantspec.data import bundled

    folder = resources.files("quantspec.data") / bundled.SAMPLE_DIR
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert names == sorted([bundled.NOTICE_FILE, bundled.SAMPLE_FILE])
    notice = (folder / bundled.NOTICE_FILE).read_text(encoding="utf-8")
    for needle in ("allenai/c4", "ODC-By", "opendatacommons.org/licenses/by/1-0", "Common Crawl",
                   "commoncrawl.org/terms-of-use", bundled.SAMPLE_FILE):
        assert needle in notice
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["quantspec"]
    for name in names:  # what a wheel or sdist ships beside the modules
        assert any(fnmatch.fnmatch(f"data/{bundled.SAMPLE_DIR}/{name}", g) for g in globs), name


def test_calibration_from_bundled_sample(offline, tok):
    a = calibration_samples(tok, "c4-bundled", n=8, seqlen=64, seed=0)
    assert a.shape == (8, 64) and torch.equal(a, calibration_samples(tok, "c4-bundled", n=8, seqlen=64, seed=0))
    assert not torch.equal(a, calibration_samples(tok, "c4-bundled", n=8, seqlen=64, seed=1))
    calib = _ids_text(tok, load_text("c4-bundled").documents)
    held = _ids_text(tok, load_text("c4-bundled-heldout").documents)
    for row in a.tolist():  # a window of one calibration document, of no held-out one
        assert _window_in(row, calib) and not _window_in(row, held)


def test_fallback_order(offline, monkeypatch, tmp_path):
    from quantspec.data import bundled
    from quantspec.data.fallback import load_or_fallback

    with pytest.warns(UserWarning, match="Calibrating on c4 \\(bundled 400-doc sample: calibration"):
        name, source = load_or_fallback("c4", "calibration")
    assert name == "c4-bundled" and len(source.documents) == 300
    with pytest.warns(UserWarning, match="Measuring perplexity on c4 \\(bundled 400-doc sample: held-out"):
        assert load_or_fallback("wikitext2", "perplexity")[0] == "c4-bundled-heldout"
    with pytest.raises(QuantspecError, match="not found"):  # a file never falls back
        load_or_fallback(str(tmp_path / "nope.jsonl"), "calibration")
    monkeypatch.setattr(bundled, "SAMPLE_FILE", "lost.jsonl.gz")  # an install without the sample
    with pytest.warns(UserWarning) as caught:
        name, source = load_or_fallback("c4", "calibration")
    assert name == "pydoc" and source.label == PYDOC_LABEL
    assert any("bundled C4 sample" in str(w.message) for w in caught)
    with pytest.raises(QuantspecError, match="bundled C4 sample"):  # asked for by name: no fallback
        load_or_fallback("c4-bundled-heldout", "perplexity")


def test_fallback_keeps_a_reachable_set(offline, monkeypatch, data_dir):
    import warnings

    from quantspec.data.fallback import load_or_fallback

    monkeypatch.setenv("QUANTSPEC_DATA", str(data_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_or_fallback("c4", "calibration")[1].label == "c4"
        assert load_or_fallback("wikitext2", "perplexity")[1].label == "wikitext2"


def test_demo_offline_calibrates_on_bundled_and_measures_held_out(offline, monkeypatch, tmp_path, capsys):
    """The newcomer's path with no data: `quantspec quantize` with the recipe's c4 and the table's
    wikitext2 out of reach calibrates on the sample's calibration documents and measures
    perplexity on its held-out ones (the code before the sample picked pydoc for both)."""
    from quantspec.cli.main import main

    # The table's speed columns are not the point here (test_cli times them): no C++ build, no decode runs.
    monkeypatch.setenv("QUANTSPEC_CPU_EXT", "0")
    monkeypatch.setattr("quantspec.eval.compare.decode_tokens_per_s",
                        lambda model: {"decode_tok_s": 1.0, "static_tok_s": None})
    model, out = make_tiny_model(tmp_path, "llama"), tmp_path / "q"
    with pytest.warns(UserWarning, match="not available"):
        rc = main(["quantize", str(model), "--method", "gptq", "--group-size", "32", "--calib-samples", "4",
                   "--calib-seqlen", "64", "--compare", "--compare-windows", "2", "--out", str(out),
                   "--no-progress", "--json", str(tmp_path / "q.json")])
    assert rc == 0
    calibrated_on = json.loads((out / "quant_report.json").read_text())["calibration"]["data"]
    measured_on = json.loads((tmp_path / "q.json").read_text())["compare"]["data"]
    assert calibrated_on == "c4 (bundled 400-doc sample: calibration docs 0-299)"
    assert measured_on == "c4 (bundled 400-doc sample: held-out docs 300-399)"
    assert measured_on in capsys.readouterr().out
