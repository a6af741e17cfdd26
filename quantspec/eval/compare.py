"""The before/after table of ``quantspec quantize``: dense vs quantized, measured in one run."""

from __future__ import annotations

import statistics
import time

import torch


@torch.inference_mode()
def decode_tokens_per_s(model, prompt_ids: torch.Tensor, new_tokens: int = 32, runs: int = 3) -> float:
    """Greedy decode speed at batch 1 with the KV cache (median of ``runs``, one warm-up)."""
    from transformers import DynamicCache

    speeds = []
    for i in range(runs + 1):
        cache = DynamicCache()
        out = model(prompt_ids, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            out = model(tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        if i:  # the first run is the warm-up
            speeds.append(new_tokens / (time.perf_counter() - t0))
    return statistics.median(speeds)


def dense_size_bytes(model) -> int:
    """Bytes of a dense half-precision checkpoint of ``model`` (tied tensors counted once)."""
    seen, total = set(), 0
    for t in model.state_dict().values():
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * (2 if t.is_floating_point() else t.element_size())
    return total


def data_or_fallback(data: str) -> str:
    """``data``, or the built-in pydoc corpus (with a warning) when a named set is unreachable."""
    import warnings

    from ..data import load_text
    from ..errors import QuantspecError
    from ..quant.methods import FALLBACK_FROM

    if data not in FALLBACK_FROM:
        return data
    try:
        load_text(data)
        return data
    except QuantspecError as exc:
        warnings.warn(f"{exc} Measuring perplexity on the built-in pydoc corpus instead.", stacklevel=2)
        return "pydoc"


def compare_dense_quantized(model_spec, qdir, data="wikitext2", seqlen=512, windows=40, progress=True) -> dict:
    from ..checkpoint.load import load_quantized
    from ..checkpoint.save import folder_size_bytes
    from ..models import load_dense
    from .perplexity import perplexity

    rows = {}
    dense, tok, info = load_dense(model_spec, dtype=torch.float32, device="cpu")
    data = data_or_fallback(data)
    prompt = tok("The history of the city begins", return_tensors="pt").input_ids
    r = perplexity(dense, tok, data, seqlen=seqlen, windows=windows, progress=progress)
    rows["dense fp32"] = {
        "ppl": r["ppl"], "size_mb": dense_size_bytes(dense) / 1e6,
        "decode_tok_s": decode_tokens_per_s(dense, prompt),
    }
    dense_bf16 = dense.to(torch.bfloat16)
    rows["dense bf16"] = {"ppl": None, "size_mb": rows["dense fp32"]["size_mb"],
                          "decode_tok_s": decode_tokens_per_s(dense_bf16, prompt)}
    del dense, dense_bf16
    q = load_quantized(qdir)
    backends = sorted(set(q.quantspec_backends.values()))
    rq = perplexity(q, tok, data, seqlen=seqlen, windows=windows, progress=progress)
    rows[f"quantized ({'/'.join(backends)})"] = {
        "ppl": rq["ppl"], "size_mb": folder_size_bytes(qdir) / 1e6,
        "decode_tok_s": decode_tokens_per_s(q, prompt),
    }
    return {"data": r["data"], "seqlen": r["seqlen"], "windows": r["windows"], "tokens": r["tokens"], "rows": rows}


def format_table(table: dict) -> str:
    lines = [
        f"perplexity on {table['data']} (seqlen {table['seqlen']}, {table['windows']} windows, "
        f"{table['tokens']} tokens); decode at batch 1, 32 new tokens, median of 3",
        f"{'model':<28} {'ppl':>9} {'size MB':>9} {'decode tok/s':>13}",
    ]
    for name, row in table["rows"].items():
        ppl = f"{row['ppl']:.3f}" if row["ppl"] is not None else "-"
        lines.append(f"{name:<28} {ppl:>9} {row['size_mb']:>9.1f} {row['decode_tok_s']:>13.1f}")
    return "\n".join(lines)
