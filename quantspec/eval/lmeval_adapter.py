"""lm-evaluation-harness adapter: evaluate quantspec checkpoints (and dense models) with lm-eval.

lm-eval 0.4.13 finds models only in its own registry (``lm_eval.api.registry.model_registry``,
filled from ``lm_eval.models.MODEL_MAPPING``); it reads no entry points and ``--include_path``
is for tasks only. So the "quantspec" model must be registered in the same process before
lm-eval's CLI runs. This module is that shim::

    python -m quantspec.eval.lmeval_adapter run --model quantspec \\
        --model_args path=out/gptq-w4g128,dtype=float32 --tasks arc_easy --device cpu

takes every argument of ``lm_eval`` (``run`` may be left out), registers "quantspec", then calls
lm-eval's own CLI. From Python, ``register()`` then ``lm_eval.simple_evaluate(model="quantspec",
model_args="path=...")`` works too, and ``run_lm_eval`` does it all in one call.

Model args: ``path`` (quantized folder or any dense model spec), ``dtype`` (auto), ``backend``
(exact: the checkpoint's declared scheme, see ``kernels/backend.py``; auto is the fastest, rounded
activations for weight-only layers on CPU); every other HFLM argument (batch_size, max_length,
device, ...) passes through.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

from ..errors import QuantspecError

MODEL_NAME = "quantspec"


def _require_lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        raise QuantspecError(
            "lm-eval is not installed.", 'pip install "quantspec[lm-eval]" (or pip install lm-eval).'
        ) from exc


@functools.cache
def quantspec_lm_class() -> type:
    """The ``QuantspecLM`` class (an lm-eval HFLM over a model loaded by quantspec).

    Built on first use so that importing this module does not import lm-eval.
    """
    _require_lm_eval()
    from lm_eval.models.huggingface import HFLM

    from ..models.load import load_model

    class QuantspecLM(HFLM):
        """HFLM over a preloaded quantspec model: a quantized folder or a dense model spec."""

        def __init__(self, path: str | None = None, pretrained: str | None = None, dtype: str = "auto",
                     backend: str = "exact", device: str | None = None, **kwargs: Any):
            spec = path or pretrained
            if not spec:
                raise QuantspecError("the quantspec lm-eval model needs a model.", "pass --model_args path=DIR.")
            import torch

            device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            model, tokenizer, desc = load_model(spec, dtype=dtype, device=device, backend=backend)
            self.quantspec_model = desc
            super().__init__(pretrained=model, tokenizer=tokenizer, backend="causal", **kwargs)

        def get_model_info(self) -> dict:
            """HFLM's info plus the kernels (lm-eval writes it into its results' "config")."""
            from .perplexity import kernels_used

            return {**super().get_model_info(), "quantspec_kernels": kernels_used(self.model)}

    return QuantspecLM


def register() -> type:
    """Register "quantspec" in lm-eval's model registry (idempotent); returns the class."""
    cls = quantspec_lm_class()
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME)(cls)
    return model_registry.get(MODEL_NAME)


def _task_manager(include_path: str | Path | list | None):
    from lm_eval.tasks import TaskManager

    if include_path is None:
        return TaskManager()
    paths = include_path if isinstance(include_path, list) else [include_path]
    return TaskManager(include_path=[str(p) for p in paths])


def _check_tasks(tasks: list[str], manager) -> None:
    """QuantspecError naming every task lm-eval does not know (with close names)."""
    import difflib

    known = set(getattr(manager, "all_tasks", []) or [])
    if not known:
        return  # an lm-eval without the listing: let it report
    unknown = [t for t in tasks if t not in known and not Path(t).is_file()]
    if unknown:
        hints = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
        named = "; ".join(f"{t!r}" + (f" (did you mean {', '.join(h)}?)" if h else "")
                          for t, h in hints.items())
        raise QuantspecError(
            f"lm-eval has no task, group or tag named {named}.",
            "check the name (`lm-eval ls tasks` lists them), or pass --include-path DIR for "
            "your own task YAMLs.",
        )


def check_tasks(tasks: list[str], include_path: str | Path | list | None = None, api: bool = False) -> None:
    """QuantspecError before any model or server starts: lm-eval missing, a task it does not
    know, or (``api``: tasks through an endpoint) the packages of lm-eval's API models missing."""
    _require_lm_eval()
    if api:
        from importlib.util import find_spec

        missing = [m for m in ("aiohttp", "tenacity", "requests", "tqdm") if find_spec(m) is None]
        if missing:
            raise QuantspecError(f"lm-eval through a server needs {', '.join(missing)}.",
                                 'pip install "lm-eval[api]" (or "quantspec[lm-eval]")')
    _check_tasks(tasks, _task_manager(include_path))


def _plain(value: Any) -> Any:
    """Make lm-eval's numbers JSON-safe (numpy scalars, NaN stays a float)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    return value


def run_lm_eval(model_path: str, tasks: list[str], limit: int | float | None = None,
                include_path: str | Path | list | None = None, batch_size: int = 1, device: str = "cpu",
                num_fewshot: int | None = None, dtype: str = "auto", backend: str = "exact",
                seed: int = 0, log_samples: bool = False, lm=None, kernels: dict | None = None) -> dict[str, Any]:
    """Run lm-eval tasks on a quantized folder or dense model; returns a JSON-safe dict.

    {"tasks": {task: {metric: value}}, "n_samples": {...}, "configs": {task: version},
     "limit", "num_fewshot", "model", "kernels" (``perplexity.kernels_used``), "lm_eval_version"}
    and, with ``log_samples``, "samples".
    ``lm`` may be an already built QuantspecLM (reused across calls), or any lm-eval model with
    ``kernels`` saying what computed it (an engine behind an endpoint).
    """
    _require_lm_eval()
    import lm_eval

    from .perplexity import kernels_used

    if not tasks:
        raise QuantspecError("no lm-eval task named.", "pass --tasks e.g. arc_easy hellaswag.")
    manager = _task_manager(include_path)
    _check_tasks(tasks, manager)  # before the model is built
    lm = lm or register()(path=model_path, dtype=dtype, backend=backend, device=device, batch_size=batch_size)
    out = lm_eval.simple_evaluate(
        model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
        task_manager=manager, log_samples=log_samples,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
        bootstrap_iters=0,
    )
    if out is None:
        raise QuantspecError("lm-eval returned no results.", "check the task names and --include-path.")
    results = {
        task: {k.split(",")[0]: v for k, v in metrics.items() if k != "alias" and "stderr" not in k}
        for task, metrics in out["results"].items()
    }
    report = {
        "model": model_path,
        "tasks": results,
        "n_samples": out.get("n-samples", {}),
        "configs": {t: c.get("metadata", {}).get("version") for t, c in out.get("configs", {}).items()},
        "limit": limit,
        "num_fewshot": num_fewshot,
        "kernels": kernels if kernels is not None else kernels_used(lm.model),
        "lm_eval_version": getattr(lm_eval, "__version__", None),
    }
    if log_samples:
        report["samples"] = out.get("samples", {})
    return _plain(report)


def main(argv: list[str] | None = None) -> int:
    """lm-eval's CLI with "quantspec" registered first (``python -m quantspec.eval.lmeval_adapter``)."""
    _require_lm_eval()
    register()
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    parser = HarnessCLI()
    saved = sys.argv
    sys.argv = ["lm_eval", *argv]  # HarnessCLI.parse_args reads sys.argv (and adds "run" if absent)
    try:
        args = parser.parse_args()
    finally:
        sys.argv = saved
    parser.execute(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
