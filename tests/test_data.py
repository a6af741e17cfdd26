"""Data sources and calibration sampling (offline; tiny tokenizer; shared data folder when present)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_tiny_tokenizer

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
    assert "pydoc" in err.value.fix


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


def test_calibration_too_little_data(offline, tmp_path, tok):
    txt = tmp_path / "small.txt"
    txt.write_text("a short text " * 5)
    with pytest.raises(QuantspecError, match="tokens") as err:
        calibration_samples(tok, str(txt), n=4, seqlen=64)
    assert "lower" in err.value.fix
