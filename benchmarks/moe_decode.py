"""MoE decode speed: a W4 (RTN, g128) Qwen3-MoE model on quantspec's kernels against the same
model dense in bf16, batch 1, on this machine; the W4 model with its output head dense (bf16,
the default recipe) and with the head quantized too (at these depths the 131 MB head is a large
share of what a W4 token reads).

The model has realistic expert shapes (hidden 2048, 64 experts, top-8, moe-intermediate 768,
16 heads / 4 KV heads of 128) with random weights, and ``--layers`` blocks (default 4: about
1.2 B parameters, 2.4 GB in bf16). Only the active experts' weights are read per token, so a
4-bit model reads about a quarter of the bytes. Both models decode through the same static
decoder (``runtime.decoder.StaticDecoder``; the dense one also through transformers), prefill
``--prompt`` tokens then greedy-decode ``--new`` tokens; the modes are timed in turn, round after
round (interleaved, so machine noise hits all alike), and the median tokens/s per mode is
reported with every round's value.

    python benchmarks/moe_decode.py                   # writes benchmarks/results/moe-decode-<cpu>.{json,md}
    python benchmarks/moe_decode.py --layers 2 --rounds 3 --out /tmp   # a quick look
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE))


def build(layers: int, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(
        vocab_size=32000, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=16,
        num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
        moe_intermediate_size=768, intermediate_size=6144, max_position_embeddings=4096,
        tie_word_embeddings=False, norm_topk_prob=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


def decode(decoder, prompt: torch.Tensor, new: int) -> float:
    """Seconds to decode ``new`` tokens greedily after a prefill of ``prompt`` (prefill not timed)."""
    decoder.reset()
    logits = decoder.forward([prompt], keep=1)
    token = logits[0, -1].argmax().view(1)
    t0 = time.perf_counter()
    for _ in range(new):
        token = decoder.forward([token], keep=1)[0, -1].argmax().view(1)
    return time.perf_counter() - t0


def expert_bytes(model: torch.nn.Module) -> dict[str, int]:
    """Bytes of the weights one token reads in the MoE blocks' experts (top-k of them)."""
    from quantspec.kernels.quant_linear import QuantLinear

    cfg = model.config
    per_expert = 0
    for name, mod in model.named_modules():
        if ".experts.0." in name and ".layers.0." in name:
            if isinstance(mod, QuantLinear):
                per_expert += sum(t.numel() * t.element_size() for t in mod.format_tensors().values())
            elif isinstance(mod, torch.nn.Linear):
                per_expert += mod.weight.numel() * mod.weight.element_size()
    if per_expert == 0:  # fused experts
        e = model.model.layers[0].mlp.experts
        per_expert = (e.gate_up_proj[0].numel() + e.down_proj[0].numel()) * e.gate_up_proj.element_size()
    return {"per_expert": per_expert, "per_token": per_expert * cfg.num_experts_per_tok * cfg.num_hidden_layers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--backend", default="auto", help="the W4 model's kernel backend")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    from kernels_cpu import cpu_name

    from quantspec.models.experts import linearize_experts
    from quantspec.quant.api import quantize_model
    from quantspec.quant.recipe import Recipe
    from quantspec.runtime.decoder import StaticDecoder
    from quantspec.runtime.kv import KVDecoder

    dense = build(args.layers)
    scheme = {"bits": 4, "group_size": 128, "symmetric": True}
    quantized, backends, quantize_seconds = {}, set(), 0.0
    for label, ignore in (("W4 g128, head bf16", ["lm_head"]), ("W4 g128, head W4 too", [])):
        model = build(args.layers)
        linearize_experts(model)
        recipe = Recipe.from_dict({"method": "rtn", "format": "gptq", "scheme": scheme, "ignore": ignore})
        t0 = time.perf_counter()
        quantized[label], report = quantize_model(model, recipe, backend=args.backend, progress=True)
        quantize_seconds += time.perf_counter() - t0
        backends |= set(report["backends"].values())
    backends = sorted(backends)
    quant = quantized["W4 g128, head bf16"]
    modes = {
        "dense bf16 (transformers)": KVDecoder(dense),
        "dense bf16 (static decoder)": StaticDecoder(dense),
        **{f"{label} (static decoder)": StaticDecoder(m) for label, m in quantized.items()},
    }
    prompt = torch.randint(3, 32000, (args.prompt,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        for dec in modes.values():  # warm-up: kernels built, caches sized
            decode(dec, prompt, 4)
        rounds: dict[str, list[float]] = {m: [] for m in modes}
        for r in range(args.rounds):
            for mode, dec in modes.items():
                rounds[mode].append(args.new / decode(dec, prompt, args.new))
            print(json.dumps({"round": r, **{m: round(v[-1], 2) for m, v in rounds.items()}}), flush=True)
    med = {m: statistics.median(v) for m, v in rounds.items()}
    base = med["dense bf16 (transformers)"]
    result = {
        "command": "python benchmarks/moe_decode.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
        "python": platform.python_version(), "when": time.strftime("%Y-%m-%d %H:%M"),
        "model": {"layers": args.layers, "hidden": 2048, "experts": 64, "top_k": 8, "moe_intermediate": 768},
        "prompt": args.prompt, "new_tokens": args.new, "rounds": rounds, "median_tokens_per_s": med,
        "speedup_vs_dense_transformers": {m: v / base for m, v in med.items()},
        "speedup_vs_dense_static": {m: v / med["dense bf16 (static decoder)"] for m, v in med.items()},
        "w4_backends": backends, "quantize_seconds": round(quantize_seconds, 1),
        "expert_bytes_per_token": {"dense": expert_bytes(dense)["per_token"], "w4": expert_bytes(quant)["per_token"]},
        "head_bytes": {"bf16": dense.lm_head.weight.numel() * 2},
    }
    slug = cpu_name().split()[0].lower() if cpu_name() else "cpu"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"moe-decode-{slug}.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# MoE decode, batch 1: W4 vs dense bf16 ({result['machine']}, {result['threads']} threads)", "",
             f"Qwen3-MoE shapes, random weights: {args.layers} blocks, hidden 2048, 64 experts, top-8, "
             f"moe-intermediate 768; prefill {args.prompt} tokens, then {args.new} greedy tokens; median of "
             f"{args.rounds} interleaved rounds. W4 = RTN g128 symmetric, backend {', '.join(backends)}. "
             f"Expert bytes read per token: dense {result['expert_bytes_per_token']['dense'] / 1e6:.1f} MB, "
             f"W4 {result['expert_bytes_per_token']['w4'] / 1e6:.1f} MB; the bf16 head {result['head_bytes']['bf16'] / 1e6:.1f} MB. "
             f"Raw data: moe-decode-{slug}.json.", "",
             "| mode | tokens/s (median) | rounds | vs dense (transformers) | vs dense (static decoder) |",
             "|---|---|---|---|---|"]
    for m in modes:
        lines.append(f"| {m} | {med[m]:.2f} | {', '.join(f'{v:.2f}' for v in rounds[m])} | "
                     f"{result['speedup_vs_dense_transformers'][m]:.2f}x | {result['speedup_vs_dense_static'][m]:.2f}x |")
    lines += ["", "Command:", "", f"    {result['command']}"]
    (args.out / f"moe-decode-{slug}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
