"""Speculative decoding on tiny random models of many transformers families: lossless or refused.

For each family (the test suite's tiny models with ``--tiny``, every causal-LM model type of the
installed transformers with ``--all``: ``tests/helpers.auto_tiny``), greedy speculative decoding of
two left-padded prompts must give exactly ``generate``'s tokens, with each draft kind:

- ``self`` / ``self-tree``: the target quantized in memory (``self:w4g32``), chains and dynamic
  token trees, verified through quantspec's runtime (the fp32 default);
- ``self-hf``: the same chain verified through transformers' own forward (``fast_verify=False``);
- ``ngram``: prompt lookup;
- ``eagle`` / ``eagle-tree``: an EAGLE head trained for the family here (``train_head`` on the
  target's own text, one epoch: training must run, acceptance is not the point), chains and trees;
- ``self-sample``: the ``self`` chain with rejection sampling (temperature 1, top-k 20, seeded): it
  must run and return tokens (the sampled law itself is tested in tests/test_specdec_verify.py).

A family that speculative decoding cannot serve must be refused with a QuantspecError (one line
naming the reason), never crash and never return other tokens than the target's.

    python benchmarks/specdec_sweep.py --tiny [--out benchmarks/results/specdec-sweep-tiny]
    python benchmarks/specdec_sweep.py --all --out benchmarks/results/specdec-sweep-all
"""

from __future__ import annotations

import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from arch_sweep import family_types, summary, sweep_args, table
from helpers import auto_tiny, tiny_model

from quantspec.errors import QuantspecError, one_line
from quantspec.specdec import SamplingConfig, speculative_generate
from quantspec.specdec.eagle.proposer import eagle_proposer
from quantspec.specdec.eagle.train import TrainConfig, train_head
from quantspec.specdec.factory import make_proposer

MODES = ("self", "self-hf", "self-tree", "self-sample", "ngram", "eagle", "eagle-tree")
NEW = 12


def decoder_overrides(model_type: str) -> dict:
    """What a user decoding with the type sets beside ``helpers.SHRINK``: ``is_decoder`` (BERT-style
    types used as causal LMs are bidirectional without it) and, for latent attention (MLA), as many
    KV heads as query heads, as every released MLA config has."""
    from transformers import CONFIG_MAPPING

    extra = {"is_decoder": True}
    if hasattr(CONFIG_MAPPING[model_type](), "kv_lora_rank"):
        extra["num_key_value_heads"] = 4  # SHRINK's num_attention_heads
    return extra


def prompts(vocab: int) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Two prompts of different lengths, left-padded (ids, mask), and the rows themselves."""
    g = torch.Generator().manual_seed(0)
    hi = min(vocab, 300)
    rows = [torch.randint(3, hi, (9,), generator=g), torch.randint(3, hi, (5,), generator=g)]
    rows[1] = torch.cat([rows[1], rows[1][:3]])  # a repeat, so n-gram lookup has something to draft
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, r in enumerate(rows):
        ids[b, width - len(r):], mask[b, width - len(r):] = r, 1
    return ids, mask, rows


def reference(model, rows: list[torch.Tensor]) -> list[list[int]]:
    """``generate``'s greedy tokens per row, up to and including its first stop token."""
    out = []
    for r in rows:
        ids = model.generate(r[None], attention_mask=torch.ones(1, len(r), dtype=torch.int64), do_sample=False,
                             max_new_tokens=NEW)[0, len(r):]
        out.append([int(t) for t in ids])
    return out


def run_mode(model, mode: str, ids, mask, refs, head_dir: Path) -> str:
    try:
        if mode.startswith("eagle"):
            if not (head_dir / "eagle_config.json").is_file():
                g = torch.Generator().manual_seed(1)
                windows = torch.randint(3, min(int(model.config.get_text_config().vocab_size), 300), (8, 24),
                                        generator=g)
                cfg = TrainConfig(samples=8, seqlen=24, epochs=1, batch_size=4, draft_vocab=64, val_fraction=0.25,
                                  prompts="text")
                train_head(model, windows, cfg, head_dir, {"target": "sweep"}, progress=False)
            prop = eagle_proposer(str(head_dir), model)
        else:
            prop = make_proposer("ngram" if mode == "ngram" else "self:w4g32", model,
                                 vocab=None if mode == "ngram" else 0)
        sampled = mode.endswith("sample")
        out, stats = speculative_generate(model, prop, ids, attention_mask=mask, max_new_tokens=NEW, k=3,
                                          fast_verify=False if mode == "self-hf" else None,
                                          tree="dynamic" if mode.endswith("tree") else None, seed=0,
                                          sampling=SamplingConfig(1.0, top_k=20) if sampled else None)
        got = [[int(t) for t in out[b, ids.shape[1]:]] for b in range(len(refs))]
        if sampled:  # a law, not tokens, to compare: every row must have run
            return f"ok {stats.accepted}/{stats.proposed}" if stats.new_tokens >= len(refs) else "WRONG no tokens"
        for b, ref in enumerate(refs):
            if got[b][:len(ref)] != ref:
                at = next(i for i, (x, y) in enumerate(zip(got[b], ref)) if x != y) if any(
                    x != y for x, y in zip(got[b], ref)) else min(len(got[b]), len(ref))
                return f"WRONG row {b} from token {at}"
        return f"ok {stats.accepted}/{stats.proposed}"
    except QuantspecError as exc:
        return "refused: " + one_line(exc, 160)
    except Exception as exc:  # noqa: BLE001 - a crash is what this sweep exists to find
        where = traceback.extract_tb(exc.__traceback__)[-1]
        why = one_line(exc, 160)
        return f"CRASH {type(exc).__name__}: {why} ({Path(where.filename).name}:{where.lineno})"


def write_report(results: dict[str, dict[str, str]], modes: list[str], out: Path, argv: str) -> list:
    """``out``.json (the raw rows) and ``out``.md (the table); returns the crashes and wrong outputs."""
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    untried = {n: r for n, r in results.items() if "model" in r}
    ran = {n: r for n, r in results.items() if n not in untried}
    bad = [(n, m) for n, r in ran.items() for m, v in r.items() if v.startswith(("CRASH", "WRONG"))]
    lines = [(f"# Speculative decoding on tiny random models of {len(results)} families "
              f"(transformers {transformers.__version__}, torch {torch.__version__})"), "",
             ("Greedy (but `self-sample`), k = 3, 12 new tokens, two left-padded prompts: `ok A/P` (A of P drafted "
              "tokens accepted) means the tokens equal `generate`'s (`self-sample`: it ran). Modes: see the script's "
              "docstring."), "",
             f"Command: `python benchmarks/specdec_sweep.py {argv}`; raw: the JSON of the same name.", "",
             *table(ran, modes)]
    lines += summary(len(ran), len(bad), "crashes or wrong outputs", {n: r["model"] for n, r in untried.items()})
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return bad


def main() -> None:
    args = sweep_args(__doc__, "specdec-sweep", "--modes", MODES)
    families = args.families.split(",") if args.families else family_types(args.all, tiny=True)
    modes = args.modes.split(",")
    results: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in families:
            try:
                model = auto_tiny(name, **decoder_overrides(name)) if args.all else tiny_model(name)
                model.generation_config.pad_token_id = model.generation_config.pad_token_id or 0
                ids, mask, rows = prompts(int(model.get_input_embeddings().weight.shape[0]))
                refs = reference(model, rows)
            except Exception as exc:  # a type we cannot shrink or run is reported, not tried
                if not args.all:
                    raise
                results[name] = {"model": f"({type(exc).__name__}: {one_line(exc, 80)})"}
                print(name, results[name], flush=True)
                continue
            results[name] = {m: run_mode(model, m, ids, mask, refs, Path(tmp) / name) for m in modes}
            print(name, results[name], flush=True)
    bad = write_report(results, modes, Path(args.out), " ".join(sys.argv[1:]))
    print(f"{len(bad)} crashes or wrong outputs", bad)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
