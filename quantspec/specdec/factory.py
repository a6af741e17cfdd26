"""``make_proposer``: a proposer from a short spec, and the draft/target compatibility check.

Specs: ``ngram`` (or ``ngram:MAX_N``), ``eagle:/path/to/head`` (an EAGLE head trained for the
target by ``quantspec train-draft``), ``self:w4g128`` (the target quantized in memory; any
``w{bits}g{group}`` or ``w{bits}gpc``), ``self:/path/to/checkpoint`` (a quantized checkpoint of
the target, e.g. GPTQ or AWQ+GPTQ: they agree with the target more often than RTN), or a model
id / folder / GGUF (a smaller model sharing the target's tokenizer). A ``self:`` draft's output
head is quantized to 8 bits per channel unless told otherwise.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..errors import QuantspecError
from ..core.scheme import QuantScheme
from .draft_vocab import DEFAULT_DRAFT_VOCAB, corpus_frequent_tokens, prune_head, wrap_head
from .proposers import DraftModel, NGram, Proposer
from .selfdraft import QuantizedSelf

PROBES = (
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def main(argv):\n    return 0\n",
    "  indented\ttabs\n\n",
    "1234567890 3.14159",
    "naïve café, Zürich, 東京",
)


SCHEME_NAME = re.compile(r"w(\d+)g(\d+|pc)(-asym)?")  # w4g128, w8gpc, w4g64-asym


def parse_scheme(text: str) -> QuantScheme:
    """``w4g128`` / ``w8gpc`` / ``w4g64-asym`` -> QuantScheme."""
    m = SCHEME_NAME.fullmatch(text.strip().lower())
    if not m:
        raise QuantspecError(
            f"'{text}' is not a scheme name.", "use e.g. self:w4g128, self:w4g64, self:w8gpc."
        )
    group = -1 if m.group(2) == "pc" else int(m.group(2))
    return QuantScheme(bits=int(m.group(1)), group_size=group, symmetric=not m.group(3))


def head_scheme(text: str) -> QuantScheme | None:
    """The scheme of ``--draft-head`` (None: ``same`` or ``dense``, decided by the draft)."""
    if text in ("same", "dense"):
        return None
    if not SCHEME_NAME.fullmatch(text.strip().lower()):
        raise QuantspecError(
            f"draft head '{text}' is not a scheme name.",
            "use e.g. w8gpc (the default), w4g32-asym, same (the body's) or dense.",
        )
    return parse_scheme(text)  # a scheme name whose bits or group size cannot be: its own message


def check_spec(spec: str) -> None:
    """Refuse, before the target loads, a spec that cannot make a draft: an n-gram size that is
    not a whole number >= 1, an ``eagle:`` folder without a head, a ``self:`` that is neither a
    folder nor a scheme name, a prefix with nothing after it. (A model id or folder is checked
    when it loads.)"""
    spec = spec.strip()
    prefix = next((p for p in ("ngram:", "eagle:", "self:") if spec.startswith(p)), "")
    if not spec[len(prefix):].strip():
        raise QuantspecError(f"draft '{spec}' names no draft.",
                             "use e.g. --draft ngram, self:w4g128, eagle:HEAD_FOLDER or a draft model's folder.")
    if spec.startswith("ngram:"):
        size = spec[len("ngram:"):]
        if not size.isdigit() or int(size) < 1:
            raise QuantspecError(f"draft '{spec}': the n-gram size '{size}' is not a whole number >= 1.",
                                 "use e.g. --draft ngram or --draft ngram:3.")
    elif spec.startswith("eagle:"):
        from .eagle.head import head_files

        head_files(spec[len("eagle:"):])
    elif spec.startswith("self:") and not Path(spec[len("self:"):]).expanduser().is_dir():
        parse_scheme(spec[len("self:"):])
    elif not spec.startswith("self:") and Path(spec).expanduser().is_dir():
        from ..checkpoint.load import is_quantized_folder

        if is_quantized_folder(Path(spec).expanduser()):
            raise QuantspecError(f"draft {spec} is a quantized checkpoint.",
                                 f"give it as --draft self:{spec} (a quantized draft runs through quantspec's layers).")


def _name(model: torch.nn.Module) -> str:
    return getattr(getattr(model, "config", None), "_name_or_path", "") or "target"


def _vocab_rows(model: torch.nn.Module) -> int:
    emb = model.get_output_embeddings()
    return int(emb.out_features if hasattr(emb, "out_features") else emb.weight.shape[0])


def check_same_vocab(target, draft, target_tokenizer=None, draft_tokenizer=None,
                     target_name: str = "target", draft_name: str = "draft") -> None:
    """Raise QuantspecError unless the draft scores the same token ids as the target.

    Checks the logit sizes, the special token ids, and (with both tokenizers) the ids of a
    probe set of strings.
    """
    fix = "use a draft from the same model family (same tokenizer), or --draft ngram / self:w4g128."
    vt, vd = _vocab_rows(target), _vocab_rows(draft)
    if vt != vd:
        raise QuantspecError(
            f"draft {draft_name} has {vd} vocabulary logits but target {target_name} has {vt}.", fix
        )
    if target_tokenizer is None or draft_tokenizer is None:
        return
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        a, b = getattr(target_tokenizer, attr, None), getattr(draft_tokenizer, attr, None)
        if a is not None and b is not None and a != b:
            raise QuantspecError(
                f"{attr} is {b} in draft {draft_name} but {a} in target {target_name}.", fix
            )
    for text in PROBES:
        a = target_tokenizer.encode(text, add_special_tokens=False)
        b = draft_tokenizer.encode(text, add_special_tokens=False)
        if a != b:
            raise QuantspecError(
                f"draft {draft_name} and target {target_name} tokenize {text!r} differently "
                f"({b[:8]} vs {a[:8]}).", fix
            )


def draft_dtype(target: torch.nn.Module, dtype: torch.dtype | str | None = None) -> torch.dtype:
    """The draft's compute dtype: ``dtype`` when given (a torch dtype or its name), else the
    target's, except bfloat16 for an fp32 target on a CPU with the bf16 few-row product (a draft
    is read every token and needs speed, not the last bits; verification stays the target's)."""
    if isinstance(dtype, str) and dtype != "auto":
        value = getattr(torch, dtype, None)
        if not isinstance(value, torch.dtype) or not value.is_floating_point:
            raise QuantspecError(f"'{dtype}' is not a floating dtype.",
                                 "use auto, float32, bfloat16 or float16.")
        return value
    if isinstance(dtype, torch.dtype):
        return dtype
    param = next(target.parameters())
    if param.dtype == torch.float32 and param.is_cpu:
        from ..kernels.dense import gemv_op

        if gemv_op(torch.bfloat16) is not None:
            return torch.bfloat16
    return param.dtype


def _load_draft(spec: str, target, dtype: torch.dtype):
    device = next(target.parameters()).device
    try:
        from ..models import load_dense
    except ImportError:  # models/ not available: a plain local folder or hub id
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).to(device).eval()
        return model, AutoTokenizer.from_pretrained(spec)
    model, tokenizer, _ = load_dense(spec, dtype=dtype, device=device)
    return model, tokenizer


def draft_token_ids(target: torch.nn.Module, tokenizer, size: int) -> torch.Tensor | None:
    """The tokens a draft head of ``size`` tokens scores (``draft_vocab.corpus_frequent_tokens``,
    the target's stop and special tokens always among them), or None for the whole vocabulary
    (``size`` 0 or at least the vocabulary)."""
    from .loop import stop_ids

    vocab = _vocab_rows(target)
    if size < 0:
        raise QuantspecError(f"--draft-vocab {size} is negative.", "use 0 (the whole vocabulary) or a token count.")
    if size == 0 or size >= vocab:
        return None
    if tokenizer is None:
        raise QuantspecError("a pruned draft vocabulary needs the target's tokenizer to rank tokens.",
                             "pass tokenizer= to make_proposer, or vocab=0.")
    always = sorted(({int(i) for i in getattr(tokenizer, "all_special_ids", [])} | stop_ids(target)) & set(range(vocab)))
    if len(always) >= size:
        raise QuantspecError(f"--draft-vocab {size} does not hold the {len(always)} special tokens.",
                             f"use --draft-vocab {len(always) + 1} or more (or 0 for all).")
    return corpus_frequent_tokens(tokenizer, size, vocab, always)


def make_proposer(spec: str, target: torch.nn.Module, tokenizer=None,
                  dtype: torch.dtype | str | None = None, head: str = "w8gpc",
                  vocab: int | None = None) -> Proposer:
    """A proposer from a spec string (see module docstring); ``tokenizer`` is the target's,
    ``dtype`` the draft model's (see ``draft_dtype``). ``head``: the output head of a ``self:``
    draft, and every weight of an ``eagle:`` head: a scheme name (default ``w8gpc``, see
    ``selfdraft.DRAFT_HEAD``), ``same`` (a ``self:`` draft's body scheme) or ``dense``.
    ``vocab``: a draft model's head scores this many tokens (``draft_token_ids``) and those of
    the text it continues; 0: every token; None: the default (``draft_vocab.DEFAULT_DRAFT_VOCAB``;
    n-gram and eagle: drafts have no head to prune)."""
    spec = spec.strip()
    model_draft = not (spec == "ngram" or spec.startswith(("ngram:", "eagle:")))
    if vocab is None:
        vocab = DEFAULT_DRAFT_VOCAB if model_draft else 0
    if vocab and not model_draft:
        raise QuantspecError(f"--draft-vocab prunes a draft model's output head; {spec} has none of its own.",
                             "drop --draft-vocab (an eagle: head keeps the vocabulary it was trained with).")
    if spec == "ngram" or spec.startswith("ngram:"):
        max_n = int(spec.split(":", 1)[1]) if ":" in spec else 3
        return NGram(max_n=max_n)
    if spec.startswith("eagle:"):
        from .eagle.proposer import eagle_proposer

        if head == "same":
            raise QuantspecError("--draft-head same names a self: draft's body scheme; an eagle: head has none.",
                                 "use a scheme (w8gpc, the default) or dense for an eagle: head.")
        return eagle_proposer(spec[len("eagle:"):], target, head_scheme(head))
    dtype = draft_dtype(target, dtype)
    token_ids = draft_token_ids(target, tokenizer, vocab)
    if spec.startswith("self:"):
        rest = spec[len("self:"):]
        scheme = head_scheme(head)
        if Path(rest).expanduser().is_dir():
            prop = QuantizedSelf.from_checkpoint(str(Path(rest).expanduser()), target, dtype=dtype,
                                                 head_scheme=scheme, token_ids=token_ids)
            check_same_vocab(target, prop.model, target_name=_name(target), draft_name=spec)
            return prop
        return QuantizedSelf.from_target(target, parse_scheme(rest), include_lm_head=head != "dense",
                                         dtype=dtype, head_scheme=scheme, token_ids=token_ids)
    model, draft_tok = _load_draft(spec, target, dtype)
    name = _name(target)
    check_same_vocab(target, model, tokenizer, draft_tok, target_name=name, draft_name=spec)
    pruned = None
    if token_ids is not None:
        source = model.get_output_embeddings()  # the draft's own full head: rows for add_tokens
        prune_head(model, token_ids)
        pruned = wrap_head(model, token_ids, _vocab_rows(target), source)
    return DraftModel(model, name=spec, pruned=pruned)
