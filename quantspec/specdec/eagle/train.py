"""Training an EAGLE head on the target's features (``quantspec train-draft``).

Data: the target's own greedy replies (self-distillation, ``distill.py``) to ``samples`` requests
with ``prompts`` (``instructions``, the default, made from local text, or a JSONL file;
``prompts.py``); or (``prompts="text"``) ``samples`` windows of ``seqlen`` tokens of local text
(``data.calibration_samples``) as they are, or the target's replies to each window's first
``prompt_tokens`` tokens as a chat prompt; and their target features
(``features.py``; with ``--quantized``, the quantized target's, so the head learns the model that
will serve). A seeded ``val_fraction`` of the windows is held out.

The defaults (instructions, 384 windows of 384 tokens, 8 epochs, ``unroll`` 1) were chosen on
SmolLM2-135M by the acceptance on the validation prompts (docs/decisions/eagle-training.md):
1.51 tokens per target call at k = 4 against 1.12 for the earlier defaults (C4 text, 256 x 512,
3 epochs, unroll 2), trained from scratch in 21.5 minutes on a 2-core CPU.

Objective per position t (EAGLE-1): the head reads ``(f_t, x_{t+1})`` and predicts ``f_{t+1}``;
loss = smooth-L1 to the real ``f_{t+1}`` + ``cls_weight`` x the cross-entropy of the head's
draft-vocabulary distribution against the target's (its LM head on the real ``f_{t+1}``,
restricted to the draft vocabulary). ``unroll`` > 1 adds EAGLE-3's training-time test: pass d
reads the features pass d-1 predicted (the real ``f_0`` first), as drafting at depth d does,
and adds its loss; gradients flow through the unrolled inputs.

Draft vocabulary: the ``draft_vocab`` most frequent next tokens of the training windows.
Resumable: ``train_state.pt`` in the output folder (head, optimizer, schedule, step, RNG) is
written atomically every ``save_every`` steps and at each epoch's end; a run with the same
settings continues from it. The head is also written as vLLM's EAGLE-1 draft
(``vllm-eagle/``, ``export.py``). The report (``train_report.json``) holds the losses and, per
epoch, the held-out top-1 agreement of the head with the target at depths 1..unroll, over every
scored position (``val_agreement``) and, for self-distilled windows, over the positions that
predict a reply token (``val_reply_agreement``: what the head drafts when serving).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ...checkpoint.atomic import atomic_write_bytes, atomic_write_text
from ...errors import QuantspecError
from ..draft_vocab import frequent_tokens
from .export import export_vllm
from .features import claim_folder, extract_features, load_features
from .head import EagleConfig, EagleHead, check_target
from .prompts import BUILTIN, TEXT, training_prompts

STATE_FILE = "train_state.pt"
REPORT_FILE = "train_report.json"
VLLM_FOLDER = "vllm-eagle"  # the head as vLLM's EAGLE-1 draft (export.py)


@dataclass(frozen=True)
class TrainConfig:
    data: str = "c4"
    samples: int = 384
    seqlen: int = 384
    epochs: int = 8
    batch_size: int = 4
    lr: float = 1e-3
    warmup: float = 0.05  # fraction of the steps
    cls_weight: float = 0.1
    noise: float = 0.0  # uniform noise U(-noise, noise) on the real input features in training (EAGLE-1: 0.1)
    unroll: int = 1
    draft_vocab: int = 8192
    val_fraction: float = 0.05
    seed: int = 0
    save_every: int = 50
    prompt_tokens: int = 0  # > 0 (with prompts="text"): the target's own greedy text after that many (distill.py)
    prompts: str = BUILTIN  # "instructions" or a JSONL file: the target's replies to these requests; "text": none

    def __post_init__(self):
        if self.prompts == "":  # the earlier spelling of "text"
            object.__setattr__(self, "prompts", TEXT)
        checks = [
            (self.samples >= 2, f"samples={self.samples}", "use at least 2 windows"),
            (self.seqlen >= 8, f"seqlen={self.seqlen}", "use windows of at least 8 tokens"),
            (self.epochs >= 1, f"epochs={self.epochs}", "train at least 1 epoch"),
            (self.batch_size >= 1, f"batch_size={self.batch_size}", "use a batch of at least 1 window"),
            (self.lr > 0, f"lr={self.lr}", "use a positive learning rate"),
            (0 <= self.warmup < 1, f"warmup={self.warmup}", "use a fraction in [0, 1)"),
            (self.cls_weight >= 0, f"cls_weight={self.cls_weight}", "use a weight >= 0"),
            (self.noise >= 0, f"noise={self.noise}", "use an amplitude >= 0 (0: none)"),
            (1 <= self.unroll <= 8, f"unroll={self.unroll}", "use 1 (no training-time test) to 8"),
            (self.draft_vocab >= 2, f"draft_vocab={self.draft_vocab}", "use at least 2 tokens"),
            (0 < self.val_fraction < 1, f"val_fraction={self.val_fraction}", "use a fraction in (0, 1)"),
            (self.save_every >= 1, f"save_every={self.save_every}", "use at least 1 step"),
            (0 <= self.prompt_tokens < self.seqlen, f"prompt_tokens={self.prompt_tokens}",
             "use 0 (the text as it is) or fewer tokens than seqlen"),
            (not (self.prompts != TEXT and self.prompt_tokens),
             f"prompts={self.prompts!r} with prompt_tokens={self.prompt_tokens}",
             "use one of them: requests (--prompts) or window prompts (--prompts text --prompt-tokens P)"),
        ]
        for ok, what, fix in checks:
            if not ok:
                raise QuantspecError(f"train-draft: {what} is invalid.", fix + ".")


def draft_vocabulary(tokens: torch.Tensor, size: int, vocab: int) -> torch.Tensor:
    """The ``size`` most frequent next tokens of ``tokens`` [n, L] (ties: lower id), ascending."""
    return frequent_tokens([tokens[:, 1:]], size, vocab)


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The target's LM head as a dense [V, H] weight (a quantized head dequantized)."""
    head = model.get_output_embeddings()
    if hasattr(head, "quant_result"):
        return head.quant_result().dequantize(torch.float32)
    return head.weight.detach().to(torch.float32)


def scored(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """bool [B, width]: position t of a window predicts feature t + 1, which is text (not the
    filler after a self-distilled reply's end) when t + 1 < the window's length."""
    return torch.arange(1, width + 1).unsqueeze(0) < lengths.unsqueeze(1)


def unrolled_losses(head: EagleHead, feats: torch.Tensor, emb: torch.Tensor, unroll: int,
                    cls_weight: float, valid: torch.Tensor | None = None,
                    noise: torch.Tensor | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The training loss of windows (features [B, L, H], next-token embeddings [B, L-1, H]; the
    positions ``valid`` [B, L-1] scores, default all) and the head's predictions [B, L-1, H] of
    each pass (pass d predicts at depth d). ``noise`` [B, L-1, H] is added to the real features
    the head reads (not to the features it predicts)."""
    real_in, target = feats[:, :-1], feats[:, 1:]
    if noise is not None:
        real_in = real_in + noise
    pos = torch.arange(real_in.shape[1], device=feats.device).unsqueeze(0).expand(feats.shape[0], -1)
    weight = torch.ones(real_in.shape[:2], device=feats.device) if valid is None else valid.to(feats.dtype)
    with torch.no_grad():
        p = F.softmax(head.logits(target), dim=-1)
    total, preds, inputs = feats.new_zeros(()), [], real_in
    for d in range(unroll):
        pred, _ = head(inputs, emb, pos)
        sl = slice(d, None)  # positions before d read only real features: pass d-1 scored them
        w = weight[:, sl]
        count = w.sum().clamp(min=1.0)
        reg = (F.smooth_l1_loss(pred[:, sl], target[:, sl], reduction="none").mean(-1) * w).sum() / count
        ce = (-(p[:, sl] * F.log_softmax(head.logits(pred[:, sl]), dim=-1)).sum(-1) * w).sum() / count
        total = total + reg + cls_weight * ce
        preds.append(pred)
        inputs = torch.cat([real_in[:, :1], pred[:, :-1]], dim=1)
    return total / unroll, preds


def agreement(head: EagleHead, batches, full_head: torch.Tensor, unroll: int) -> list[float]:
    """Held-out top-1 agreement at depth 1..unroll over ``batches`` of (features, embeddings,
    valid positions): the head's draft (as a target id) equals the target's argmax next token,
    over the valid positions each depth scores."""
    return agreements(head, ((f, e, (v,)) for f, e, v in batches), full_head, unroll)[0]


@torch.no_grad()
def agreements(head: EagleHead, batches, full_head: torch.Tensor, unroll: int) -> list[list[float]]:
    """``agreement`` under several position masks from one pass of the head: ``batches`` of
    (features, embeddings, (mask, ...)); one list per mask."""
    hits, counts = None, None
    for feats, emb, masks in batches:
        _, preds = unrolled_losses(head, feats, emb, unroll, 0.0)  # the predictions do not depend on a mask
        truth = F.linear(feats[:, 1:], full_head).argmax(-1)
        if hits is None:
            hits, counts = [[0.0] * unroll for _ in masks], [[0] * unroll for _ in masks]
        for d, pred in enumerate(preds):
            same = (head.token_ids[head.logits(pred).argmax(-1)] == truth)[:, d:]
            for m, mask in enumerate(masks):
                hits[m][d] += float(same[mask[:, d:]].sum())
                counts[m][d] += int(mask[:, d:].sum())
    return [[h / max(1, c) for h, c in zip(hm, cm)] for hm, cm in zip(hits, counts)]


def reply_positions(starts: torch.Tensor, width: int) -> torch.Tensor:
    """bool [B, width]: position t predicts token t + 1, a token of the target's reply (not of
    its prompt) when t + 1 >= the window's reply start."""
    return torch.arange(1, width + 1).unsqueeze(0) >= starts.unsqueeze(1)


def _distilled(model, tokenizer, windows, requests, cfg: TrainConfig, folder: Path, progress: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The target's own text, each window's length and where its reply starts (its prompt's
    length; ``distill.py``), written batch by batch beside the features (a stopped run continues
    from the batches it wrote)."""
    from .distill import request_prompts, self_distilled_windows, window_prompts

    if tokenizer is None:
        raise ValueError("self-distillation (prompts, prompt_tokens) needs the target's tokenizer")
    prompts = request_prompts(tokenizer, requests) if requests is not None \
        else window_prompts(tokenizer, windows, cfg.prompt_tokens)
    starts = torch.tensor([min(int(p.numel()), cfg.seqlen) for p in prompts], dtype=torch.int64)
    return (*self_distilled_windows(model, prompts, cfg.seqlen, progress=progress, folder=folder), starts)


def _schedule(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def _save_state(path: Path, **state) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    atomic_write_bytes(path, buf.getvalue())


def train_head(model: torch.nn.Module, windows: torch.Tensor | None, cfg: TrainConfig, out: str | Path,
               key: dict, progress: bool = True, tokenizer=None) -> dict:
    """Train an EAGLE head for ``model``; write it to ``out``. ``windows``: int64 [n, L] when
    ``cfg.prompts`` is ``text``, else None (the requests ``cfg.prompts`` names are read here).

    ``key``: what the features are of (target, data, quantized checkpoint), for the feature
    cache and the resume check. ``tokenizer``: the target's, needed with ``cfg.prompts`` and
    ``cfg.prompt_tokens`` (the prompts go through its chat template). Returns the report (also
    written to ``train_report.json``).
    """
    from tqdm.auto import tqdm

    check_target(model)  # before any reply or feature is computed
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    key = {**key, "prompt_tokens": cfg.prompt_tokens}
    requests = None
    if cfg.prompts != TEXT:
        requests = training_prompts(cfg.prompts, cfg.samples, cfg.seed, prose=cfg.data)
        digest = hashlib.sha256(json.dumps(requests).encode()).hexdigest()[:16]
        key = {**key, "prompts": cfg.prompts, "prompts_sha256": digest}
    elif windows is None:
        raise ValueError("train_head needs token windows when cfg.prompts is 'text'")
    lengths = starts = None
    if cfg.prompts != TEXT or cfg.prompt_tokens:
        claim_folder(out / "features", key)  # before the distilled text is reused or written
        windows, lengths, starts = _distilled(model, tokenizer, windows, requests, cfg, out / "features", progress)
    paths = extract_features(model, windows, out / "features", key, progress=progress)
    t_feat = time.perf_counter() - t0
    tokens, feats16 = load_features(paths)
    n = tokens.shape[0]
    valid = scored(torch.full((n,), tokens.shape[1]) if lengths is None else lengths, tokens.shape[1] - 1)
    reply = None if starts is None else valid & reply_positions(starts, tokens.shape[1] - 1)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed))
    n_val = max(1, round(n * cfg.val_fraction))
    val, train = order[:n_val], order[n_val:]
    if train.numel() == 0:
        raise QuantspecError(f"train-draft: {n} windows leave none for training after the held-out ones.",
                             "use more --samples.")
    vocab = int(model.get_input_embeddings().weight.shape[0])
    full_head = lm_head_weight(model)
    table = model.get_input_embeddings().weight.detach().to(torch.float32)
    ids = draft_vocabulary(tokens[train], cfg.draft_vocab, vocab)
    hcfg = EagleConfig.for_target(model.config, ids.numel(), target=str(key.get("target", "")),
                                  target_features=str(key.get("features", "dense")))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        head = EagleHead(hcfg)
    head.set_vocabulary(ids, full_head)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(train.numel() / cfg.batch_size)
    total = steps_per_epoch * cfg.epochs
    warm = max(1, round(total * cfg.warmup))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _schedule(s, total, warm))
    run_key = {"features": key, "train": asdict(cfg)}
    state_path = out / STATE_FILE
    step, history = 0, []
    if state_path.is_file():
        state = torch.load(state_path, weights_only=False)
        if state["key"] != run_key:
            raise QuantspecError(f"{out} holds a training run with other settings.",
                                 "use another --out, or --overwrite to start over.")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, history = state["step"], state["history"]

    def batch_of(idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return feats16[idx].to(torch.float32), F.embedding(tokens[idx][:, 1:], table), valid[idx]

    held_masks = {"val_agreement": valid, **({} if reply is None else {"val_reply_agreement": reply})}

    def held_out() -> dict[str, list[float]]:
        """The held-out agreement under each of ``held_masks``, from one pass of the head."""
        batches = ((*batch_of(idx)[:2], tuple(m[idx] for m in held_masks.values()))
                   for idx in val.split(cfg.batch_size))
        accs = agreements(head, batches, full_head, cfg.unroll)
        return {name: [round(a, 4) for a in acc] for name, acc in zip(held_masks, accs)}

    def save() -> None:
        _save_state(state_path, key=run_key, head=head.state_dict(), opt=opt.state_dict(),
                    sched=sched.state_dict(), step=step, history=history)

    t1 = time.perf_counter()
    with tqdm(total=total, initial=step, desc="train eagle head", unit="step", disable=not progress) as bar:
        while step < total:
            epoch, within = divmod(step, steps_per_epoch)
            perm = train[torch.randperm(train.numel(), generator=torch.Generator().manual_seed(cfg.seed + 1 + epoch))]
            idx = perm[within * cfg.batch_size:(within + 1) * cfg.batch_size]
            head.train()
            feats, emb, ok = batch_of(idx)
            noise = None
            if cfg.noise:  # seeded by the step, so a resumed run draws the same noise
                g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
                noise = (torch.rand(feats[:, :-1].shape, generator=g) * 2 - 1) * cfg.noise
            loss, _ = unrolled_losses(head, feats, emb, cfg.unroll, cfg.cls_weight, ok, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.4f}")
            end_of_epoch = step % steps_per_epoch == 0 or step == total
            if end_of_epoch:
                head.eval()
                history.append({"epoch": epoch + 1, "step": step, "loss": round(loss.item(), 5), **held_out()})
            if end_of_epoch or step % cfg.save_every == 0:
                save()
    head.eval()
    head.save(out)
    export_vllm(head, model.config, out / VLLM_FOLDER, overwrite=True)
    val_tokens = tokens[val][:, 1:][valid[val]]
    report = {
        "head": asdict(hcfg), "train": asdict(cfg), "features": key, "windows": n, "held_out": n_val,
        "scored_positions": int(valid.sum()),
        **({} if reply is None else {"reply_positions": int(reply.sum())}),
        "history": history, "draft_vocab_coverage": round(float(torch.isin(val_tokens, ids).float().mean()), 4),
        "feature_seconds": round(t_feat, 1), "train_seconds_this_run": round(time.perf_counter() - t1, 1),
    }
    atomic_write_text(out / REPORT_FILE, json.dumps(report, indent=1) + "\n")
    return report
