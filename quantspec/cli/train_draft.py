"""``quantspec train-draft TARGET --out HEAD``: train an EAGLE draft head for a target.

Use it with ``quantspec generate TARGET --draft eagle:HEAD`` (and in ``bench-specdec``), or in vLLM
as ``--speculative-config '{"method": "eagle", "model": "HEAD/vllm-eagle", ...}'``.
``--quantized CKPT`` trains on the quantized target's features, for a head that drafts for that
checkpoint. A stopped run continues from its output folder (features and training state);
``--overwrite`` starts over.
"""

from __future__ import annotations

import shutil
from dataclasses import fields
from pathlib import Path

from ..errors import QuantspecError


def add_parser(sub) -> None:
    from ..specdec.eagle.train import TrainConfig

    p = sub.add_parser("train-draft", help="train an EAGLE draft head on the target's features")
    p.add_argument("target", help="the target model (id, folder, alias)")
    p.add_argument("--out", required=True, help="folder for the head (eagle_head.safetensors, eagle_config.json)")
    p.add_argument("--quantized", metavar="CHECKPOINT",
                   help="learn from this quantized checkpoint of the target (the model that will serve)")
    p.add_argument("--overwrite", action="store_true", help="discard what --out holds and start over")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    defaults = TrainConfig()
    helps = {"data": "training text: c4 (default), wikitext2, c4-bundled, pydoc, python-stdlib (code), a .txt/.jsonl path, or a mixture such as c4+python-stdlib",
             "samples": "token windows (a held-out fraction is kept for validation)",
             "noise": "amplitude of the uniform noise added to the real input features in training (0: none)",
             "unroll": "draft depths trained per window (EAGLE-3's training-time test; 1: none)",
             "draft_vocab": "the head scores the N most frequent next tokens of the training text",
             "prompt_tokens": "with --prompts text: 0 learns from the text as it is; P > 0 from the target's own "
                              "greedy continuation of each window's first P tokens (as a chat prompt)",
             "prompts": "learn from the target's own replies to --samples requests: 'instructions' (the default, made "
                        "from local C4 and Python code; --data is then their prose) or a JSONL file of "
                        "{\"prompt\": ...}; 'text': from --data windows (see --prompt-tokens)"}
    for f in fields(TrainConfig):
        value = getattr(defaults, f.name)
        p.add_argument("--" + f.name.replace("_", "-"), type=type(value), default=value,
                       help=helps.get(f.name, f"default {value}"))
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    from ..data.calibration import calibration_samples
    from ..data.tokens import tokenizer_fingerprint
    from ..models.load import load_model, model_label
    from ..specdec.eagle.head import CONFIG_FILE
    from ..specdec.eagle.prompts import BUILTIN, TEXT, training_prompts
    from ..specdec.eagle.train import REPORT_FILE, STATE_FILE, TrainConfig, train_head

    marks = (CONFIG_FILE, STATE_FILE, REPORT_FILE, "features")  # what a head folder, or a started one, holds

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})
    out = Path(args.out).expanduser()
    if out.exists() and not out.is_dir():
        raise QuantspecError(f"--out {out} is a file.", "give a folder for the head.")
    if out.is_dir() and any(out.iterdir()) and not any((out / m).exists() for m in marks):
        raise QuantspecError(f"--out {out} holds other files and no EAGLE head or its training state "
                             f"({', '.join(marks)}).", "give a new or empty folder for the head.")
    if args.threads is not None and args.threads < 1:
        raise QuantspecError(f"--threads {args.threads} is invalid.", "use at least 1 thread.")
    if cfg.prompts not in (BUILTIN, TEXT):
        training_prompts(cfg.prompts, cfg.samples, cfg.seed)  # a bad file is refused before the model loads
    if args.threads:
        torch.set_num_threads(args.threads)
    target, tokenizer, desc = load_model(args.target)
    if desc["kind"] != "dense":
        raise QuantspecError(f"{args.target} is a quantized checkpoint.",
                             "give the dense target, and the checkpoint as --quantized.")
    name = model_label(desc)
    model = target
    if args.quantized:
        model, _, qdesc = load_model(args.quantized)
        if qdesc["kind"] != "quantized":
            raise QuantspecError(f"--quantized {args.quantized} is not a quantized checkpoint.",
                                 "pass a folder written by `quantspec quantize`.")
        tv, qv = target.get_input_embeddings().weight.shape, model.get_input_embeddings().weight.shape
        if tv != qv:
            raise QuantspecError(f"--quantized {args.quantized} has embeddings {tuple(qv)}, the target {tuple(tv)}.",
                                 "pass a checkpoint quantized from this target.")
        del target
    if args.overwrite and out.exists():
        shutil.rmtree(out)
    windows = None if cfg.prompts != TEXT else calibration_samples(tokenizer, cfg.data, cfg.samples, cfg.seqlen, cfg.seed)
    key = {"target": name, "features": args.quantized or "dense", "data": cfg.data, "samples": cfg.samples,
           "seqlen": cfg.seqlen, "seed": cfg.seed, "tokenizer": tokenizer_fingerprint(tokenizer)}
    report = train_head(model, windows, cfg, out, key, progress=not args.no_progress, tokenizer=tokenizer)
    last = report["history"][-1] if report["history"] else {}
    which = "val_reply_agreement" if "val_reply_agreement" in last else "val_agreement"
    acc = ", ".join(f"d{d + 1} {a:.3f}" for d, a in enumerate(last.get(which, [])))
    over = " (reply tokens)" if which == "val_reply_agreement" else ""
    print(f"EAGLE head for {name} in {out}: held-out agreement with the target{over} {acc}; "
          f"draft vocabulary {report['head']['draft_vocab_size']} tokens "
          f"(covers {report['draft_vocab_coverage']:.1%} of held-out next tokens)")
    return 0
