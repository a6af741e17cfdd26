"""The before/after table of ``quantspec quantize``: dense vs quantized, measured in one run."""

from __future__ import annotations

import torch

from ..sizes import tensors_bytes

DECODE = dict(prompt_lengths=(16,), batch_sizes=(1,), decode_prompt_length=16, new_tokens=32, repeats=3, warmup=1)


@torch.inference_mode()
def decode_tokens_per_s(model) -> dict[str, float | None]:
    """Greedy decode tokens/s at batch 1 (32 new tokens, median of 3 runs after a warm-up),
    through transformers ("decode_tok_s") and through quantspec's StaticDecoder ("static_tok_s",
    None for a family it does not declare)."""
    from .speed import SpeedConfig, measure_speed

    result = measure_speed(model, SpeedConfig(**DECODE, static=True))
    static = result.get("decode_static", {})
    return {"decode_tok_s": result["decode"]["1"]["tokens_per_s"],
            "static_tok_s": static["1"]["tokens_per_s"] if "1" in static else None}


def dense_size_bytes(model) -> int:
    """Bytes of a dense half-precision checkpoint of ``model`` (tied tensors counted once)."""
    return tensors_bytes(model.state_dict().values(), distinct=True, float_bytes=2)


def data_or_fallback(data: str) -> str:
    """``data``, or (with a warning) the first fallback for perplexity that loads when a named set
    is unreachable: the bundled C4 sample's held-out documents, then pydoc
    (``data.fallback.load_or_fallback``)."""
    from ..data.fallback import load_or_fallback

    return load_or_fallback(data, "perplexity")[0]


def compare_dense_quantized(model_spec, qdir, data="wikitext2", seqlen=512, windows=40, progress=True) -> dict:
    from ..checkpoint.load import load_quantized
    from ..checkpoint.save import folder_size_bytes
    from ..models import load_dense
    from .perplexity import perplexity

    rows = {}
    dense, tok, info = load_dense(model_spec, dtype=torch.float32, device="cpu")
    data = data_or_fallback(data)
    r = perplexity(dense, tok, data, seqlen=seqlen, windows=windows, progress=progress)
    rows["dense fp32"] = {
        "ppl": r["ppl"], "size_mb": dense_size_bytes(dense) / 1e6, **decode_tokens_per_s(dense),
    }
    dense_bf16 = dense.to(torch.bfloat16)
    rows["dense bf16"] = {"ppl": None, "size_mb": rows["dense fp32"]["size_mb"],
                          **decode_tokens_per_s(dense_bf16)}
    del dense, dense_bf16
    exact = load_quantized(qdir, backend="exact")  # perplexity of the scheme the checkpoint declares
    rq = perplexity(exact, tok, data, seqlen=seqlen, windows=windows, progress=progress)
    del exact
    q = load_quantized(qdir)  # decode through the fastest kernels
    backends = sorted(set(q.quantspec_backends.values()))
    rows[f"quantized ({'/'.join(backends)})"] = {
        "ppl": rq["ppl"], "size_mb": folder_size_bytes(qdir) / 1e6, **decode_tokens_per_s(q),
    }
    return {"data": r["data"], "seqlen": r["seqlen"], "windows": r["windows"], "tokens": r["tokens"],
            "ppl_kernels": rq["kernels"], "rows": rows}


def format_table(table: dict) -> str:
    lines = [
        f"perplexity on {table['data']} (seqlen {table['seqlen']}, {table['windows']} windows, "
        f"{table['tokens']} tokens); decode at batch 1, 32 new tokens, median of 3, through "
        "transformers and through quantspec's static-cache decoder; the quantized perplexity on backend "
        f"{table['ppl_kernels']['backend']} (activations {table['ppl_kernels']['activations']}), its decode "
        "on the backend in its name",
        f"{'model':<28} {'ppl':>9} {'size MB':>9} {'decode tok/s':>13} {'static tok/s':>13}",
    ]
    for name, row in table["rows"].items():
        ppl = f"{row['ppl']:.3f}" if row["ppl"] is not None else "-"
        static = f"{row['static_tok_s']:.1f}" if row.get("static_tok_s") is not None else "-"
        lines.append(f"{name:<28} {ppl:>9} {row['size_mb']:>9.1f} {row['decode_tok_s']:>13.1f} {static:>13}")
    return "\n".join(lines)
