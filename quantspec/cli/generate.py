"""``quantspec generate MODEL_OR_DIR --prompt TEXT``: generate text, optionally speculatively."""

from __future__ import annotations

import time

from ._common import write_json
from .bench_specdec import (
    add_specdec_args,
    check_decode_args,
    sampling_from_args,
    tree_from_args,
)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a model or checkpoint")
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--json")
    add_specdec_args(p)
    p.set_defaults(func=run)


def timing(new_tokens: int, setup_s: float, generate_s: float) -> dict:
    """The JSON timing fields of every mode: building the proposer (``setup_seconds``: loading
    a draft model or quantizing the self-draft; 0 for the target alone) apart from generating,
    and ``tokens_per_s`` over generation only (``load_seconds``, the target's, is apart too)."""
    return {"new_tokens": new_tokens, "setup_seconds": round(setup_s, 3),
            "generate_seconds": round(generate_s, 3),
            "tokens_per_s": round(new_tokens / generate_s, 2) if generate_s > 0 else None}


def run(args) -> int:
    import torch

    from ..errors import QuantspecError
    from ..models.source import check_context
    from ..specdec.bench import encode

    tree = tree_from_args(args)  # refused before anything loads
    sampling = sampling_from_args(args)
    check_decode_args(args)
    t_load = time.perf_counter()
    from ..models.load import load_model, model_label

    model, tok, desc = load_model(args.model, args.dtype, args.device, args.backend)
    if args.chat and not getattr(tok, "chat_template", None):
        raise QuantspecError(f"--chat: the tokenizer of {args.model} has no chat template.",
                             "drop --chat, or use a model whose tokenizer has one.")
    input_ids = encode(tok, args.prompt, args.chat).to(args.device)
    check_context(model.config, input_ids.shape[1] + args.max_new_tokens,
                  f"the prompt ({input_ids.shape[1]} tokens) with --max-new-tokens {args.max_new_tokens}",
                  "shorten the prompt or lower --max-new-tokens (together at most {context}).")
    out: dict = {"model": model_label(desc), "prompt": args.prompt, "mode": "speculative" if args.draft else "target"}
    t0 = time.perf_counter()
    out["load_seconds"] = round(t0 - t_load, 3)
    if args.draft:
        from .. import specdec
        from ..specdec.loop import check_tree

        if tree is not None:  # refused before the draft is built
            check_tree(model, input_ids.shape[1], args.max_new_tokens, tree, args.fast_verify)
        proposer = specdec.make_proposer(args.draft, model, tok, dtype=args.draft_dtype,
                                         head=args.draft_head, vocab=args.draft_vocab)
        t1 = time.perf_counter()
        ids, stats = specdec.speculative_generate(
            model, proposer, input_ids, max_new_tokens=args.max_new_tokens, k=args.k,
            adaptive=args.adaptive, sampling=sampling,
            seed=args.seed, fast_verify=args.fast_verify, tree=tree,
        )
        out["specdec"] = stats.to_dict()
        out["tree"] = tree.to_dict() if tree is not None else None
    else:
        t1 = time.perf_counter()  # the target alone builds nothing before generating
        kw = {"do_sample": args.temperature > 0}
        if args.temperature > 0:
            if args.seed is not None:
                torch.manual_seed(args.seed)
            kw.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        with torch.inference_mode():
            ids = model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids),
                max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id or tok.eos_token_id, **kw,
            )
    t2 = time.perf_counter()
    new = ids[0, input_ids.shape[1]:]
    text = tok.decode(new, skip_special_tokens=True)
    print(text)
    out.update(text=text, **timing(int(new.numel()), setup_s=t1 - t0, generate_s=t2 - t1))
    if args.json:
        write_json(args.json, out)
    return 0
