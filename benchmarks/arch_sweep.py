"""Every quantization method on tiny random models of many transformers families, end to end.

For each family: a 2-layer random model (hidden 64) and its tokenizer are saved, then quantized
by rtn / gptq / awq (4-bit g32) and smoothquant (W8A8) through ``quantspec.quantize``, loaded
with ``quantspec.load_quantized`` (reference backend) and compared with the dense model on 16
tokens: rel = mean squared logit error / mean square of the logits. A family that quantspec
cannot handle must fail with a QuantspecError (a clear message), never with a crash.

A method may name a float scheme and a KV cache: ``gptq:nvfp4``, ``rtn:fp8-dynamic+kv:fp8:head``
(``method[:scheme][+kv:KIND:STRATEGY]``; compressed-tensors; the loaded model then runs its forward
on the checkpoint's quantized KV cache). ``--tiny`` takes the families of the test suite's tiny
models (``tests/helpers.py``: MoE families with MLA and GPT-OSS included) instead of ``FAMILIES``.
``--all`` takes every causal-LM model type the installed transformers lists, each shrunk by setting
whichever of ``SHRINK``'s width fields its config has (``auto_tiny``); a type whose shrunk model does
not build, has more than 20M parameters, a Linear with more than 8192 inputs (GPTQ's Hessian alone
would be 256 MiB+) or fails its own forward is reported as "no tiny model" and not quantized.

    python benchmarks/arch_sweep.py [--out benchmarks/results/arch-sweep] [--families A,B] [--methods ...]
    python benchmarks/arch_sweep.py --all --methods rtn,gptq,awq,gptq:nvfp4+kv:fp8:tensor --out benchmarks/results/arch-sweep-all
    python benchmarks/arch_sweep.py --tiny --methods rtn:fp8-dynamic,rtn:fp8-static,rtn:fp8-block,gptq:fp8-weight,gptq:nvfp4,awq:mxfp4,rtn+kv:fp8:head,gptq:nvfp4+kv:int8:tensor --out benchmarks/results/arch-sweep-float
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import ARCHS, COMMON, MOE_ARCHS, UNDECLARED, auto_tiny, make_tiny_tokenizer, tiny_model  # noqa: E402

import quantspec  # noqa: E402
from quantspec.errors import QuantspecError, one_line  # noqa: E402
from quantspec.quant.recipe import CalibrationConfig, Recipe  # noqa: E402
from quantspec.core.kv_config import KVCacheConfig  # noqa: E402
from quantspec.core.scheme import SCHEME_PRESETS, QuantScheme  # noqa: E402
from quantspec.runtime.kv import cache_kwarg  # noqa: E402
from quantspec.runtime.kv_quant import new_cache  # noqa: E402

FAMILIES = {  # config class -> the fields a tiny model of it needs besides COMMON
    "LlamaConfig": {}, "MistralConfig": {"sliding_window": None}, "Qwen2Config": {},
    "Qwen3Config": {"head_dim": 16}, "GemmaConfig": {"head_dim": 16},
    "Gemma2Config": {"head_dim": 16, "sliding_window": 64, "query_pre_attn_scalar": 16},
    "Gemma3TextConfig": {"head_dim": 16, "sliding_window": 64, "query_pre_attn_scalar": 16},
    "Phi3Config": {}, "PhiConfig": {}, "GPT2Config": {"n_inner": 128},
    "OPTConfig": {"ffn_dim": 128, "word_embed_proj_dim": 64}, "GPTNeoXConfig": {},
    "GPTJConfig": {"n_inner": 128, "rotary_dim": 8},
    "FalconConfig": {"new_decoder_architecture": True, "num_kv_heads": 2}, "StableLmConfig": {},
    "Starcoder2Config": {}, "MixtralConfig": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "Qwen2MoeConfig": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                       "shared_expert_intermediate_size": 128},
    "Qwen3MoeConfig": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                       "head_dim": 16},
    "OlmoConfig": {}, "Olmo2Config": {}, "GraniteConfig": {}, "CohereConfig": {}, "BloomConfig": {},
}
METHODS = ("rtn", "gptq", "awq", "smoothquant")
def recipe_for(method: str, cal: CalibrationConfig) -> Recipe:
    """``method``: rtn | gptq | awq | smoothquant, or ``method:scheme[+kv:KIND:STRATEGY]``."""
    method, _, kv = method.partition("+")
    method, _, scheme = method.partition(":")
    kv_cache = None
    if kv:
        _, kind, strategy = kv.split(":")
        kv_cache = KVCacheConfig(kind=kind, strategy=strategy, samples=4)
    if scheme or kv_cache is not None:
        return Recipe(name="sweep", method=method, format="compressed-tensors", calibration=cal, kv_cache=kv_cache,
                      scheme=SCHEME_PRESETS[scheme] if scheme else QuantScheme(4, 32, True))
    if method == "smoothquant":
        return Recipe(name="sweep", method=method, format="compressed-tensors", calibration=cal,
                      scheme=QuantScheme(8, -1, True, activations="int8-token-dynamic"))
    return Recipe(name="sweep", method=method, format="awq" if method == "awq" else "gptq",
                  scheme=QuantScheme(4, 32, method != "awq"), calibration=cal)


def run_one(folder: Path, dense, method: str, cal, out: Path) -> str:
    try:
        recipe = recipe_for(method, cal)
        ckpt = quantspec.quantize(str(folder), recipe, out, progress=False, device="cpu", overwrite=True).out
        q = quantspec.load_quantized(ckpt, backend="reference")
        ids = torch.randint(3, 300, (1, 16), generator=torch.Generator().manual_seed(0))
        cache = {cache_kwarg(q): new_cache(q), "use_cache": True} if recipe.kv_cache is not None else {}
        with torch.no_grad():
            a, b = q(input_ids=ids, **cache).logits.float(), dense(input_ids=ids).logits
        return f"ok {float((a - b).pow(2).mean() / b.pow(2).mean()):.3g}"
    except QuantspecError as exc:
        return f"refused: {str(exc)[:160]}"
    except Exception as exc:  # a crash is what this sweep exists to find
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return f"CRASH {type(exc).__name__}: {str(exc)[:160]} ({Path(where.filename).name}:{where.lineno})"


def family_types(every_type: bool, tiny: bool) -> list[str]:
    """The families a sweep runs: every causal-LM model type of the installed transformers
    (``every_type``), the test suite's tiny models (``tiny``), else ``FAMILIES``."""
    if every_type:
        from transformers.models.auto import modeling_auto

        return sorted(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    return list(ARCHS + MOE_ARCHS + tuple(UNDECLARED)) if tiny else list(FAMILIES)


def table(rows: dict[str, dict[str, str]], columns: list[str]) -> list[str]:
    """A markdown table, one row per family, one column per method or mode."""
    return ["| family | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns),
            *(f"| {n} | " + " | ".join(r[c] for c in columns) + " |" for n, r in rows.items())]


def sweep_args(doc: str, name: str, column_flag: str, columns: tuple[str, ...]) -> argparse.Namespace:
    """The command line of a sweep over families: --out (default benchmarks/results/NAME), --families,
    --tiny, --all and ``column_flag`` (comma-separated, default ``columns``); torch on one thread and
    transformers quiet, as every sweep runs."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / name))
    ap.add_argument("--families", default="", help="comma-separated families (default: all of the set)")
    ap.add_argument(column_flag, default=",".join(columns))
    ap.add_argument("--tiny", action="store_true", help="the test suite's tiny models (tests/helpers.py) as families")
    ap.add_argument("--all", action="store_true", help="every causal-LM model type of the installed transformers")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    return args


def summary(ran: int, bad: int, what: str, untried: dict[str, str], untried_note: str = "") -> list[str]:
    """The lines under a sweep's table: families run, ``bad`` of ``what``, the types with no tiny model."""
    lines = ["", f"{ran} families run, {bad} {what}."]
    if untried:
        lines += ["", f"No tiny model of {len(untried)} types{untried_note}: "
                  + "; ".join(f"{n} {why}" for n, why in untried.items())]
    return lines


def write_report(results: dict[str, dict[str, str]], methods: list[str], out: Path, argv: str) -> list:
    """``out``.json (the raw rows) and ``out``.md (the table); returns the crashes."""
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    lines = [f"# Every method on tiny random models of {len(results)} families "
             f"(transformers {transformers.__version__}, torch {torch.__version__})", "",
             "rel: mean squared logit error of the loaded checkpoint / mean square of the dense "
             "logits (16 tokens; 4-bit g32 for rtn/gptq/awq, W8A8 for smoothquant; a `:scheme` names a float "
             "scheme, `+kv:KIND:STRATEGY` a calibrated KV cache the forward runs on).", "",
             f"Command: `python benchmarks/arch_sweep.py {argv}`; raw: the JSON of the same name.", "",
             *([("fp8-block quantizes only Linears whose in_features are a multiple of 128 (in these tiny models, "
                 "the dense MLPs' down_proj); the others stay dense, each with its reason in quant_report.json, and a "
                 "model with none of them is refused."), ""] if any("fp8-block" in m for m in methods) else [])]
    untried = {n: r[methods[0]] for n, r in results.items() if all(v.startswith("no tiny model") for v in r.values())}
    lines += table({n: r for n, r in results.items() if n not in untried}, methods)
    crashes = [(n, m) for n, r in results.items() for m, v in r.items() if v.startswith("CRASH")]
    lines += summary(len(results) - len(untried), len(crashes), "crashes",
                     {n: why.removeprefix("no tiny model ") for n, why in untried.items()}, " (not quantized)")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return crashes


def main() -> None:
    args = sweep_args(__doc__, "arch-sweep", "--methods", METHODS)
    families = args.families.split(",") if args.families else family_types(args.all, args.tiny)
    methods = args.methods.split(",")
    results: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        text = root / "calib.txt"
        text.write_text(" ".join(["Quantization maps weights to a small grid of integers."] * 400))
        cal = CalibrationConfig(data=str(text), samples=4, seqlen=64)
        tokenizer = make_tiny_tokenizer()
        for name in families:
            folder = root / name
            try:
                if args.all:
                    dense = auto_tiny(name)
                elif args.tiny:
                    dense = tiny_model(name)
                else:
                    config = getattr(transformers, name)(**{**COMMON, **FAMILIES.get(name, {})})
                    torch.manual_seed(0)
                    dense = transformers.AutoModelForCausalLM.from_config(config).eval()
                dense.save_pretrained(folder)
            except Exception as exc:  # under --all a type we cannot shrink or save is reported, not quantized
                if not args.all:
                    raise
                why = one_line(exc, 80)  # one line for the table
                results[name] = {m: f"no tiny model ({type(exc).__name__}: {why})" for m in methods}
                print(name, results[name][methods[0]], flush=True)
                continue
            tokenizer.save_pretrained(folder)
            results[name] = {m: run_one(folder, dense, m, cal, root / f"{name}-{m.replace(':', '-')}") for m in methods}
            print(name, results[name], flush=True)
    crashes = write_report(results, methods, Path(args.out), " ".join(sys.argv[1:]))
    print(f"{len(crashes)} crashes", crashes)
    sys.exit(1 if crashes else 0)


if __name__ == "__main__":
    main()
