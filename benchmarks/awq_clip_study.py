"""Which blocks' AWQ clips help the whole model, and which block-local measure predicts it.

Phase "search": AWQ on the whole model (the given settings, block check off so every clip that
passed its pair check is kept), saving each Linear's scaled float weight and clip values.
Phase "study": from that file, per block: the block's output error on held-out calibration
sequences without / with its clips (raw MSE and per-token relative MSE), the held-out
calibration NLL of the whole model with only that block's clips, and wikitext2 perplexity of
the clip subsets that each measure keeps. (Clip rules re-chosen from recorded error curves,
and every tuned AWQ default, are measured on a validation split outside the calibration draw by
benchmarks/awq_tune_defaults.py.)

    python benchmarks/awq_clip_study.py search --model .../qwen2.5-coder-0.5b --bits 3 --group 128 --out /tmp/q.pt
    python benchmarks/awq_clip_study.py study --model .../qwen2.5-coder-0.5b --out /tmp/q.pt
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE))

from peer_common import perplexity  # noqa: E402
from quant_peers import prepare  # noqa: E402

from quantspec.formats import get_format  # noqa: E402
from quantspec.models import load_dense  # noqa: E402
from quantspec.quant.arch_infer import get_arch  # noqa: E402
from quantspec.quant.awq import (  # noqa: E402
    AWQMethod,
    AWQProbe,
    AWQSettings,
    apply_clip,
    fake_quantize,
)
from quantspec.quant.block_ops import block_forward  # noqa: E402
from quantspec.quant.calibrate import run_blockwise  # noqa: E402
from quantspec.quant.capture import capture_inputs  # noqa: E402
from quantspec.quant.plan import make_plan  # noqa: E402
from quantspec.quant.recipe import AWQOptions, Recipe  # noqa: E402
from quantspec.quant.smoothing import fold_scales, resolve_pairs  # noqa: E402


def load(args):
    with tempfile.TemporaryDirectory() as tmp:
        prepare(Path(args.model), Path(tmp) / "data.pt", 64, 512, args.windows)
        data = torch.load(Path(tmp) / "data.pt")
    model, _, _ = load_dense(args.model, dtype="float32")
    return model, data


def search(args) -> None:
    model, data = load(args)
    arch = get_arch(model)
    scheme = {"bits": args.bits, "group_size": args.group, "symmetric": False}
    recipe = Recipe.from_dict({"method": "awq", "format": "compressed-tensors", "scheme": scheme})
    plan = make_plan(model, recipe.scheme, get_format(recipe.format), recipe.targets, recipe.ignore).quantize
    fields = json.loads(args.variant)
    floats: dict[str, torch.Tensor] = {}

    class Snap(AWQProbe):  # the scaled float weights, as they are rounded
        def scaled_weight(self, name, weight):
            floats[name] = weight.detach().clone()

    report: dict = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        scales_file = Path(tmp) / "scales.safetensors"  # the kept clips, read back from the scales file
        awq = AWQOptions(clip=True, save_scales=str(scales_file), **fields.pop("awq", {}))
        method = AWQMethod(AWQSettings(awq=awq, clip_check_seqs=0, clip_model_check=False, **fields), probe=Snap())
        run_blockwise(model, arch, data["calib"], method, plan, progress=False, report=report)
        clips = {k[: -len(".clip")]: v for k, v in load_file(str(scales_file)).items() if k.endswith(".clip")}
    torch.save({"floats": floats, "clips": clips, "plan": {n: s.to_dict() for n, s in plan.items()},
                "report": report, "seconds": time.perf_counter() - t0}, args.out)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1), "clipped": len(clips),
                      "ppl_all_clips": perplexity(model, data["eval"])}), flush=True)


def fold_saved(model, arch, floats: dict[str, torch.Tensor]) -> None:
    """The saved Linears hold W * s; fold the same s into the fresh model (norms included)."""
    with torch.no_grad():
        for i, block in enumerate(arch.block_list(model)):
            for p in resolve_pairs(block, arch)[0]:
                name = f"{arch.block_name(i)}.{p.linear_names[0]}"
                if name in floats:
                    orig = p.linears[0].weight.detach().float()
                    fold_scales(p, floats[name].float().abs().sum(0) / orig.abs().sum(0).clamp(min=1e-30))


def nll(model, ids: torch.Tensor) -> float:
    total, count = 0.0, 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        for w in ids:
            logits = model(input_ids=w[None]).logits[0, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += w.numel() - 1
    return total / count


def study(args) -> None:
    from quantspec.core.scheme import QuantScheme

    model, data = load(args)
    arch = get_arch(model)
    saved = torch.load(args.out)
    floats, clips = saved["floats"], saved["clips"]
    schemes = {n: QuantScheme.from_dict(d) for n, d in saved["plan"].items()}
    mods = {n: model.get_submodule(n) for n in floats}
    fold_saved(model, arch, floats)
    quant = {n: fake_quantize(w, schemes[n]) for n, w in floats.items()}
    clipped = {n: fake_quantize(apply_clip(floats[n], c, schemes[n]), schemes[n]) for n, c in clips.items()}

    def set_weights(which: str, blocks: set[int] | None = None) -> None:
        for n, m in mods.items():
            b = block_of(n)
            if which == "float":
                w = floats[n]
            elif n in clipped and (blocks is None or b in blocks):
                w = clipped[n]
            else:
                w = quant[n]
            m.weight.data.copy_(w)

    names = [arch.block_name(i) for i in range(len(arch.block_list(model)))]

    def block_of(n: str) -> int:
        return max(i for i, b in enumerate(names) if n.startswith(b + "."))

    n_blocks = len(names)
    calib = data["calib"]
    search_seqs = set(torch.linspace(0, calib.shape[0] - 1, 16).round().long().tolist())
    held = [j for j in range(calib.shape[0]) if j not in search_seqs]
    check = [held[round(i)] for i in torch.linspace(0, len(held) - 1, 8).tolist()]
    other = [j for j in held if j not in check][:16]
    # per-block local measures, with float-propagated inputs (as the search sees them)
    set_weights("float")
    inputs, kwargs = capture_inputs(model, arch, calib[check], torch.device("cpu"))
    local = []
    blocks = arch.block_list(model)
    with torch.no_grad():
        for i, block in enumerate(blocks):
            ref = block_forward(block, inputs, kwargs[i])
            rel_in = inputs.float().pow(2).mean(-1, keepdim=True)
            rel_out = ref.float().pow(2).mean(-1, keepdim=True)
            row = {}
            own = [n for n in floats if block_of(n) == i]
            for tag, use_clip in (("plain", False), ("clip", True)):
                for n in own:
                    mods[n].weight.data.copy_(clipped[n] if use_clip and n in clipped else quant[n])
                out = block_forward(block, inputs, kwargs[i])
                d = (out - ref).float().pow(2)
                row[tag] = {"mse": float(d.mean()),
                            "rel_out": float((d.mean(-1, keepdim=True) / rel_out).mean()),
                            "rel_in": float((d.mean(-1, keepdim=True) / rel_in).mean()),
                            "nosink": float(d[:, 1:].mean())}
            for n in own:
                mods[n].weight.data.copy_(floats[n])
            row["has_clips"] = any(n in clipped for n in own)
            local.append(row)
            inputs = ref
    # end-to-end: held-out calibration NLL with only block i's clips (others quantized, no clip)
    eval_ids = calib[other]
    set_weights("float")
    print(json.dumps({"nll_float": nll(model, eval_ids)}), flush=True)
    set_weights("clip", set())
    base = nll(model, eval_ids)
    e2e = []
    for i in range(n_blocks):
        if not local[i]["has_clips"]:
            e2e.append(0.0)
            continue
        set_weights("clip", {i})
        e2e.append(nll(model, eval_ids) - base)
    set_weights("clip", None)
    all_clip = nll(model, eval_ids)
    rows = []
    for i in range(n_blocks):
        r = local[i]
        rows.append({"block": i, "e2e_dnll": e2e[i],
                     **{f"gain_{k}": r["plain"][k] / r["clip"][k] for k in r["plain"]}})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"nll_noclip": base, "nll_allclip": all_clip}), flush=True)
    subsets = {"none": set(), "all": set(range(n_blocks)), "oracle": {i for i in range(n_blocks) if e2e[i] < 0}}
    for k in ("mse", "rel_out", "rel_in", "nosink"):
        subsets[k] = {i for i in range(n_blocks) if local[i]["has_clips"] and local[i]["clip"][k] < local[i]["plain"][k]}
    for tag, keep in subsets.items():
        set_weights("clip", keep)
        print(json.dumps({"subset": tag, "blocks": sorted(keep), "calib_nll": nll(model, eval_ids),
                          "ppl": perplexity(model, data["eval"])}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=["search", "study"])
    ap.add_argument("--model", required=True)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--variant", default='{"awq": {"search_dtype": "bfloat16"}}')
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    {"search": search, "study": study}[args.phase](args)


if __name__ == "__main__":
    main()
