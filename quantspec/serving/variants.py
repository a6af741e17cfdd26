"""What gets served: one ``Target`` per server run (a checkpoint, the dense baseline, a
speculative-decoding variant of either, or an existing deployment behind ``--url``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import QuantspecError


@dataclass(frozen=True)
class Target:
    label: str
    model: str | None  # what the engine loads; None for --url
    url: str | None = None
    role: str = "checkpoint"  # "checkpoint" | "baseline" | "speculative" | "url"
    speculative: dict | None = field(default=None, hash=False)  # vLLM's speculative config

    @property
    def engine_args(self) -> tuple[str, ...]:
        """The engine flags this target adds to the common ones."""
        return ("--speculative-config", json.dumps(self.speculative)) if self.speculative else ()


def _count(text: str, k: str) -> int:
    if not k:
        return 4
    if not k.isdigit() or int(k) < 1:
        raise QuantspecError(f"--spec {text!r}: K must be a whole number of at least 1.", "e.g. --spec ngram:4")
    return int(k)


def _eagle_folder(path: str) -> str:
    """An EAGLE head trained by ``quantspec train-draft``: its vLLM export (``vllm-eagle/``)."""
    from ..specdec.eagle.train import VLLM_FOLDER

    export = Path(path).expanduser() / VLLM_FOLDER
    return str(export) if export.is_dir() else path


def parse_spec(text: str) -> tuple[str, dict]:
    """``ngram[:K]``, ``draft=PATH[:K]`` or ``eagle=HEAD[:K]`` (K default 4) -> (label suffix,
    vLLM speculative config). HEAD: a ``train-draft`` folder (its vLLM export is served) or a
    vLLM EAGLE-1 draft folder."""
    for kind in ("draft", "eagle"):
        if not text.startswith(kind + "="):
            continue
        path, sep, k = text[len(kind) + 1:].rpartition(":")
        if not sep or not k.isdigit():  # no ":K" (a ":" may belong to the path)
            path, k = text[len(kind) + 1:], ""
        if not path:
            raise QuantspecError(f"--spec {text!r} names no {kind} model.", f"write --spec {kind}=PATH[:K]")
        n = _count(text, k)
        if kind == "eagle":
            return (f"eagle:{Path(path).name}:{n}",
                    {"method": "eagle", "model": _eagle_folder(path), "num_speculative_tokens": n})
        return f"draft:{Path(path).name}:{n}", {"model": str(path), "num_speculative_tokens": n}
    head, _, k = text.partition(":")
    if head == "ngram":
        n = _count(text, k)
        return f"ngram:{n}", {"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": 4,
                              "prompt_lookup_min": 2}
    raise QuantspecError(f"--spec {text!r} is not a speculative variant.",
                         "write --spec ngram[:K], --spec draft=PATH[:K] (a draft model, e.g. a quantized "
                         "checkpoint of the target) or --spec eagle=HEAD[:K] (a train-draft head)")


def build_targets(checkpoints: list[str], *, baseline: str | None, specs: list[str], url: str | None,
                  served_name: str | None = None) -> list[Target]:
    """Baseline first (when any), then each checkpoint, then each speculative variant of each."""
    if url:
        if checkpoints or specs:
            raise QuantspecError("--url measures a running server; checkpoints and --spec start servers.",
                                 "pass either --url (with --served-model-name if it serves several) or checkpoints")
        return [Target(label=served_name or url, model=None, url=url, role="url")]
    if not checkpoints:
        raise QuantspecError("no checkpoint to serve.", "pass one or more checkpoint folders, or --url URL")
    targets = []
    if baseline:
        targets.append(Target(label=f"dense ({Path(baseline).name})", model=baseline, role="baseline"))
    for ck in checkpoints:
        targets.append(Target(label=Path(ck).name or ck, model=ck))
    for spec in specs:
        suffix, cfg = parse_spec(spec)
        for t in list(targets):
            if t.role in ("checkpoint", "baseline"):
                targets.append(Target(label=f"{t.label} +{suffix}", model=t.model, role="speculative",
                                      speculative=cfg))
    return targets
