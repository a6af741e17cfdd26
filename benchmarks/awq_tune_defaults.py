"""Re-choose AWQ's tuned defaults on a validation split; wikitext2 (the text of the published
tables) is measured beside it and never used to choose.

Validation split (``validation_windows``): the documents of
``$QUANTSPEC_DATA/c4/c4-validation-2k.jsonl`` from index 1800 on (the file's last 200) that the
calibration draw of the protocol (``calibration_samples(tok, "c4", 64, 512, seed=0)`` with the
model's own tokenizer) does not read (``quantspec.data.calibration.documents_outside_draw``), in
file order, joined with "\\n\\n"; its first 40 windows of 512 tokens. Test: wikitext2's test
split, the first 40 windows of 512 (quant_peers.py's protocol). Calibration: 64 C4 x 512, seed 0.

Phases (each appends its rows, with the command, to --json; --md is rewritten from it):

  record  one AWQ run with --variant's settings (AWQSettings fields, "awq": AWQOptions fields;
          default: the library's defaults), recording each pair's chosen scale, every clip
          search's error curve and the scaled float weights in --store; row: its perplexity.
  sweep   from --store: clips re-chosen from the recorded curves (``pick_clip``: least gain
          ``gain``, Linears ending in ``skip`` left out, "none": no clips), no pair/block/model
          checks; one row per --policies entry. Cheap: one fake quantization per policy.
  replay  from --store: the whole AWQ pipeline (statistics, clip search, pair/block/model
          checks) with the recorded scales instead of the scale search, one row per --variant;
          a variant may change clip settings only (its scales must be the recorded ones).

    python benchmarks/awq_tune_defaults.py record --model smollm2-135m --bits 3 --group 64 --store /tmp/s.pt
    python benchmarks/awq_tune_defaults.py sweep --model smollm2-135m --store /tmp/s.pt \\
        --policies '[{"src": "none"}, {"gain": 0.1}, {"gain": 0.3}]'
    python benchmarks/awq_tune_defaults.py replay --model smollm2-135m --store /tmp/s.pt \\
        --variant '{"awq": {"clip_min_gain": 0.2}}' --variant '{"clip_check_seqs": 0}'
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "peers"))
sys.path.insert(0, str(HERE))

from awq_clip_study import fold_saved  # noqa: E402
from peer_common import perplexity  # noqa: E402
from quant_peers import DATA, RESULTS  # noqa: E402

from quantspec.data import calibration_samples, cached_token_ids, load_text  # noqa: E402
from quantspec.data.calibration import documents_outside_draw  # noqa: E402
from quantspec.data.tokens import encode_text  # noqa: E402
from quantspec.eval.perplexity import window_starts  # noqa: E402
from quantspec.formats import get_format  # noqa: E402
from quantspec.models import load_dense, load_tokenizer  # noqa: E402
from quantspec.models.source import dense_folder  # noqa: E402
from quantspec.quant.arch_infer import get_arch  # noqa: E402
from quantspec.quant.awq import AWQMethod, AWQProbe, AWQSettings, apply_clip, fake_quantize, pick_clip  # noqa: E402
from quantspec.quant.calibrate import run_blockwise  # noqa: E402
from quantspec.quant.plan import make_plan  # noqa: E402
from quantspec.quant.recipe import AWQOptions, Recipe  # noqa: E402
from quantspec.core.scheme import QuantScheme  # noqa: E402

SAMPLES, SEQLEN, SEED = 64, 512, 0  # the calibration of every published AWQ table
VAL_FIRST_DOC = 1800  # validation documents: from here to the file's end, outside the draw
# the settings the recorded scales depend on: a replay may not change them
SCALE_FIELDS = ("search_tokens", "propagate")
SCALE_AWQ_FIELDS = ("grid", "duo_scaling", "search_dtype")


def validation_documents(tokenizer, docs: list[str], first: int = VAL_FIRST_DOC) -> list[int]:
    """Indices of the validation documents: ``first`` and after, outside the calibration draw."""
    lengths = [encode_text(tokenizer, d).numel() for d in docs]
    return [i for i in documents_outside_draw(lengths, SAMPLES, SEQLEN, SEED) if i >= first]


def validation_windows(tokenizer, windows: int = 40, seqlen: int = SEQLEN) -> tuple[torch.Tensor, list[int]]:
    """The validation split's token windows [windows, seqlen] and the documents they come from."""
    docs = load_text(str(DATA / "c4" / "c4-validation-2k.jsonl")).documents
    chosen = validation_documents(tokenizer, docs)
    text = "\n\n".join(docs[i] for i in chosen)
    ids = encode_text(tokenizer, text)
    starts = window_starts(ids.numel(), seqlen, seqlen, windows)
    if len(starts) < windows:
        raise SystemExit(f"the validation split holds {len(starts)} windows of {seqlen} tokens, not {windows}")
    end = tokenizer(text, return_offsets_mapping=True, verbose=False)["offset_mapping"][starts[-1] + seqlen - 1][1]
    doc_starts = [0]
    for i in chosen[:-1]:
        doc_starts.append(doc_starts[-1] + len(docs[i]) + 2)
    used = [i for i, c in zip(chosen, doc_starts) if c < end]  # the documents the windows reach
    return torch.stack([ids[s : s + seqlen] for s in starts]), used


def load_data(model_dir: Path, windows: int) -> dict:
    """Calibration ids [64, 512], wikitext2 (test) and C4 validation windows [windows, 512]."""
    tok = load_tokenizer(model_dir)
    calib = calibration_samples(tok, str(DATA / "c4" / "c4-validation-2k.jsonl"), SAMPLES, SEQLEN, seed=SEED)
    wiki = cached_token_ids(tok, load_text(str(DATA / "wikitext2" / "wikitext-2-raw-v1.test.txt")))
    test = torch.stack([wiki[s : s + SEQLEN] for s in window_starts(wiki.numel(), SEQLEN, SEQLEN, windows)])
    val, used = validation_windows(tok, windows)
    return {"calib": calib, "test": test, "val": val, "val_docs": used}


def settings_of(variant: dict) -> AWQSettings:
    fields = dict(variant)
    awq = fields.pop("awq", {})
    if "clip_skip" in fields:
        fields["clip_skip"] = tuple(fields["clip_skip"])
    return AWQSettings(awq=AWQOptions(**awq), **fields)


def model_and_plan(args):
    model, _, _ = load_dense(str(args.model_dir), dtype="float32")
    scheme = {"bits": args.bits, "group_size": args.group, "symmetric": False}
    recipe = Recipe.from_dict({"method": "awq", "format": "compressed-tensors", "scheme": scheme})
    plan = make_plan(model, recipe.scheme, get_format(recipe.format), recipe.targets, recipe.ignore).quantize
    arch = get_arch(model)
    if args.blocks:  # a smoke test: the first blocks only
        keep = tuple(arch.block_name(i) + "." for i in range(args.blocks))
        plan = {n: s for n, s in plan.items() if n.startswith(keep)}
    return model, arch, plan


def run_awq(model, arch, plan, data, settings: AWQSettings, probe: AWQProbe, before_eval=None) -> dict:
    """AWQ on the whole model with ``probe`` watching (or supplying scales); then ``before_eval()``
    and the quantized model's perplexities."""
    report: dict = {}
    t0 = time.perf_counter()
    run_blockwise(model, arch, data["calib"], AWQMethod(settings, probe=probe), plan, progress=False, report=report)
    seconds = time.perf_counter() - t0
    if before_eval:
        before_eval()
    check = next((r["clip_model_check"] for r in report.values() if "clip_model_check" in r), None)
    clipped = sum(bool(r.get("clipped")) for r in report.values())
    return {"seconds": round(seconds, 1), "clip_model_check": check, "clipped_linears": clipped,
            **evaluate(model, data)}


def evaluate(model, data: dict) -> dict:
    """Perplexity on the splits in ``data["splits"]`` (val, test); None for the others."""
    return {f"{k}_ppl": perplexity(model, data[k]) if k in data["splits"] else None for k in ("val", "test")}


class Recorder(AWQProbe):
    """Keeps each pair's scale, each clip curve and each scaled float weight; saves ``store`` to
    ``path`` after every finished block (a cut run leaves a usable prefix)."""

    def __init__(self, store: dict, path: str, blocks: list[tuple[str, ...]]):
        self.store, self.path, self.blocks = store, path, blocks

    def scale(self, pair, x_mean, search):
        s, info = search()
        self.store["scales"].append({"x_mean": x_mean.detach().clone(), "s": s.clone(), "info": info})
        return s, info

    def clip_curve(self, name, errors, amax):
        self.store["curves"][name] = (errors, amax)

    def scaled_weight(self, name, weight):
        floats = self.store["floats"]
        floats[name] = weight.detach().clone()
        done = sum(all(n in floats for n in b) for b in self.blocks)
        if done > self.store["blocks_done"]:
            self.store["blocks_done"] = done
            torch.save(self.store, self.path)


class Replayer(AWQProbe):
    """Supplies the recorded scales, in order, after checking each pair's statistics."""

    def __init__(self, scales: list[dict]):
        self.queue = list(scales)

    def scale(self, pair, x_mean, search):
        rec = self.queue.pop(0)
        if not torch.allclose(x_mean, rec["x_mean"], rtol=1e-4, atol=1e-6):
            raise SystemExit("replay: a pair's activation statistics differ from the recorded run's")
        return rec["s"].to(x_mean.device), rec["info"]


def record(args, data: dict) -> list[dict]:
    model, arch, plan = model_and_plan(args)
    blocks = [tuple(n for n in plan if n.startswith(arch.block_name(i) + ".")) for i in range(len(arch.block_list(model)))]
    blocks = [b for b in blocks if b]
    variant = json.loads(args.variant[0]) if args.variant else {}
    store = {"floats": {}, "curves": {}, "scales": [], "variant": variant, "blocks_done": 0,
             "blocks_total": len(blocks), "plan": {n: s.to_dict() for n, s in plan.items()}, "bits": args.bits, "group": args.group}
    row = run_awq(model, arch, plan, data, settings_of(variant), Recorder(store, args.store, blocks),
                  lambda: torch.save(store, args.store))
    return [{"phase": "record", "variant": variant, **row}]


def load_store(args) -> dict:
    """The record phase's file; a cut run's (``blocks_done`` short of the plan) serves the
    first blocks only (--blocks)."""
    store = torch.load(args.store)
    args.bits, args.group = store["bits"], store["group"]
    total = store["blocks_total"]
    if store["blocks_done"] < total and not 0 < args.blocks <= store["blocks_done"]:
        raise SystemExit(f"{args.store} holds {store['blocks_done']} of {total} blocks: pass --blocks N <= that")
    return store


def sweep(args, data: dict) -> list[dict]:
    store = load_store(args)
    model, arch, plan = model_and_plan(args)
    floats = {n: w for n, w in store["floats"].items() if n in plan}
    curves = {n: c for n, c in store["curves"].items() if n in plan}
    schemes = {n: QuantScheme.from_dict(d) for n, d in store["plan"].items()}
    fold_saved(model, arch, floats)
    rows = []
    for pol in json.loads(args.policies):
        skip = tuple(pol.get("skip", ()))
        chosen = {} if pol.get("src") == "none" else {
            n: pick_clip(errs[: pol.get("cap", 10)], amax, min_gain=pol.get("gain", 0.0))
            for n, (errs, amax) in curves.items() if not (skip and n.endswith(skip))}
        for n, w in floats.items():
            w = apply_clip(w, chosen[n], schemes[n]) if n in chosen else w
            model.get_submodule(n).weight.data.copy_(fake_quantize(w, schemes[n]))
        shrink = [float((c / curves[n][1]).mean()) for n, c in chosen.items()]
        rows.append({"phase": "sweep", "variant": store["variant"], "policy": pol, "clipped_linears": len(chosen),
                     "mean_clip_ratio": sum(shrink) / max(1, len(shrink)), **evaluate(model, data)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def replay(args, data: dict) -> list[dict]:
    store = load_store(args)
    recorded = settings_of(store["variant"])
    rows = []
    for text in args.variant or ["{}"]:
        variant = json.loads(text)
        settings = settings_of(variant)
        changed = [f for f in SCALE_FIELDS if getattr(settings, f) != getattr(recorded, f)]
        changed += [f"awq.{f}" for f in SCALE_AWQ_FIELDS if getattr(settings.awq, f) != getattr(recorded.awq, f)]
        if changed:
            raise SystemExit(f"variant {text} changes {changed}, which the recorded scales depend on: record again")
        model, arch, plan = model_and_plan(args)
        row = run_awq(model, arch, plan, data, settings, Replayer(store["scales"]))
        rows.append({"phase": "replay", "variant": variant, "recorded": store["variant"], **row})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def settings_label(variant: dict) -> str:
    """The variant's settings that differ from the library's defaults, or "defaults"."""
    settings, base = settings_of(variant), AWQSettings()
    diff = {k: v for k, v in asdict(settings).items() if k != "awq" and v != asdict(base)[k]}
    diff.update({f"awq.{k}": v for k, v in asdict(settings.awq).items() if v != asdict(base.awq)[k]})
    return ", ".join(f"{k}={v}" for k, v in diff.items()) or "defaults"


def write_md(path: Path, table: list[dict]) -> None:
    lines = ["# AWQ defaults on a validation split (C4 outside the calibration draw) and on wikitext2 (test)", "",
             "Validation: C4 documents 1800-1999 of c4-validation-2k.jsonl outside the 64 x 512 seed-0 calibration "
             "draw (per tokenizer), joined with \"\\n\\n\", its first windows of 512 tokens; test: wikitext2's first "
             "windows of 512 (as many of each as the windows column says; benchmarks/awq_tune_defaults.py's "
             "docstring). Defaults are chosen on the validation column only. Raw rows: awq-defaults-validation.json.",
             "",
             "| model | config | windows | phase | settings (vs the library defaults when run) | clip rule | C4 val ppl | "
             "wikitext2 ppl | s | clipped Linears | model check KL clip / none |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        pol = json.dumps(r["policy"]) if "policy" in r else "-"
        kl = r.get("clip_model_check")
        kl = f"{kl['kl_clipped']:.3f} / {kl['kl_unclipped']:.3f} ({'kept' if kl['kept'] else 'dropped'})" if kl else "-"
        label = settings_label(r["variant"]) + (f" (scales of: {settings_label(r['recorded'])})" if "recorded" in r else "")
        val, test = (f"{r[k]:.3f}" if r[k] is not None else "-" for k in ("val_ppl", "test_ppl"))
        lines.append(f"| {r['model']} | {r['config']} | {r['windows']} | {r['phase']} | {label} | {pol} | {val} | {test} | "
                     f"{r.get('seconds', '-')} | {r.get('clipped_linears', '-')} | {kl} |")
    lines += ["", "Commands (each row's `command` field in the JSON):", ""]
    lines += [f"    {c}" for c in dict.fromkeys(r["command"] for r in table)]
    path.write_text("\n".join(lines) + "\n")


def save_rows(args, rows: list[dict]) -> None:
    old = json.loads(args.json.read_text())["rows"] if args.json.exists() else []
    command = "python benchmarks/awq_tune_defaults.py " + shlex.join(sys.argv[1:])
    config = f"W{args.bits} g{args.group}" + (f", first {args.blocks} blocks" if args.blocks else "")
    meta = {"model": Path(args.model).name, "config": config, "windows": args.windows,
            "command": command, "when": time.strftime("%Y-%m-%d %H:%M"), "defaults_then": settings_label({})}
    new = [{**meta, **r} for r in rows]
    key = lambda r: json.dumps([r["model"], r["config"], r["windows"], r["phase"], r["variant"], r.get("recorded"),
                                r.get("policy")], sort_keys=True)
    fresh = {key(r) for r in new}
    table = [r for r in old if key(r) not in fresh] + new
    args.json.write_text(json.dumps({"rows": table}, indent=1))
    write_md(args.md, table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("phase", choices=["record", "sweep", "replay"])
    ap.add_argument("--model", default="smollm2-135m", help="alias or local HF folder")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--blocks", type=int, default=0, help="quantize only the first N blocks (0: all)")
    ap.add_argument("--splits", default="val,test", help="where to measure perplexity: val, test or both")
    ap.add_argument("--variant", action="append", default=None,
                    help="AWQSettings fields as JSON (\"awq\": AWQOptions fields); record takes one, replay several")
    ap.add_argument("--policies", default='[{"src": "none"}, {"gain": 0.0}, {"gain": 0.3}]')
    ap.add_argument("--store", type=Path, required=True, help="the record phase's file (scales, curves, weights)")
    ap.add_argument("--json", type=Path, default=RESULTS / "awq-defaults-validation.json")
    ap.add_argument("--md", type=Path, default=RESULTS / "awq-defaults-validation.md")
    args = ap.parse_args()
    args.model_dir = dense_folder(args.model)
    data = {**load_data(args.model_dir, args.windows), "splits": args.splits.split(",")}
    print(json.dumps({"validation_documents": data["val_docs"]}), flush=True)
    rows = {"record": record, "sweep": sweep, "replay": replay}[args.phase](args, data)
    print(json.dumps(rows[-1]), flush=True)
    save_rows(args, [{**r, "val_docs": [data["val_docs"][0], data["val_docs"][-1], len(data["val_docs"])]}
                     for r in rows])


if __name__ == "__main__":
    main()
