"""Where a W4 MoE decode token's time goes on the cpu backend: the per-expert path against the
one-op path (``kernels.cpu_moe``, op ``quantspec_cpu::moe_token``), interleaved in one process.

The model is ``moe_decode.build(layers)`` (Qwen3-MoE shapes, random weights), experts linearized
and quantized W4 g128 RTN (head too) on the default backend. Two measurements, each the median
of ``--rounds`` interleaved rounds:

* decode through the static decoder: ms per token, and how much of it is inside the experts
  modules (``LinearExperts.forward``), with the token runner bound or not;
* one MoE block, one token (8 of 64 experts, bf16): the per-expert module path, a bare Python
  loop over the bound ops (two qgemm calls and a silu_mul per expert), the 16 qgemm calls alone,
  and the one op.

With ``--rows 1,4,8``: one block step of T tokens (T in the list; 8 of 64 experts each, bf16)
only, the per-expert path (the path of T > 1 before the op took a few rows) against the one op:
the median wall and process CPU time per step over interleaved rounds, and the dispatcher op
calls of one step (counted by a TorchDispatchMode, outside the timing).

    python benchmarks/moe_token_split.py --layers 2 --rounds 5
    python benchmarks/moe_token_split.py --layers 1 --rows 1,4,8 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _decode_ms(decoder, prompt: torch.Tensor, new: int, on_start=lambda: None) -> float:
    """ms per token of ``new`` greedy tokens after a prefill; ``on_start()`` after the prefill."""
    decoder.reset()
    token = decoder.forward([prompt], keep=1)[0, -1].argmax().view(1)
    on_start()
    t0 = time.perf_counter()
    for _ in range(new):
        token = decoder.forward([token], keep=1)[0, -1].argmax().view(1)
    return (time.perf_counter() - t0) / new * 1e3


def _block_modes(experts, runner):
    from quantspec.kernels.small_ops import silu_mul

    ops, r = torch.ops.quantspec_cpu, runner
    qgemm = ops.qgemm_panel.default if r.panels else None

    def product(x, layout, e, block, n):
        if qgemm is not None:
            return qgemm(x, layout["w"][e], layout["scales"][e], layout["zeros"][e], r.src, None, r.bits, block, n)
        return ops.qgemm.default(x, layout["w"][e], layout["scales"][e], layout["zeros"][e], r.src, None,
                                 r.bits, block, True)

    h0 = torch.randn(1, r.inter).to(torch.bfloat16)

    per_expert = _without_op(experts, runner)

    def python_loop(x, ids, w):
        out = None
        for j, e in enumerate(ids[0].tolist()):
            gu = product(x, r.gu, e, r.gu_block, 2 * r.inter)
            y = product(silu_mul(gu[:, :r.inter], gu[:, r.inter:]), r.down, e, r.down_block, r.hidden)
            y = y.float() * w[0, j].float()
            out = y if out is None else out.add_(y)
        return out.to(x.dtype)

    def qgemm_only(x, ids, w):
        for e in ids[0].tolist():
            product(x, r.gu, e, r.gu_block, 2 * r.inter)
            product(h0, r.down, e, r.down_block, r.hidden)

    return {"per-expert module path": per_expert, "python loop over bound ops": python_loop,
            "the 16 qgemm calls alone": qgemm_only, "one op (moe_token)": runner}


def _without_op(experts, runner):
    """``experts``' call with its one-op runner unset: the per-expert path."""

    def per_expert(x, ids, w):
        experts.token_runner = None
        try:
            return experts(x, ids, w)
        finally:
            experts.token_runner = runner

    return per_expert


def _op_calls(fn, *args) -> int:
    """Dispatcher op calls (aten and extension ops) of one ``fn(*args)``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn(*args)
    return Count.n


def _rows_steps(experts, runner, rows: list[int], rounds: int, reps: int = 20) -> None:
    """Print, per T in ``rows``, one block step of T tokens: per-expert path against the op."""

    per_expert = _without_op(experts, runner)

    modes = {"per-expert": per_expert, "one op": experts}
    inputs = {}
    for t in rows:
        g = torch.Generator().manual_seed(t)
        x = torch.randn(t, runner.hidden, generator=g).to(torch.bfloat16)
        ids = [torch.stack([torch.randperm(len(experts), generator=g)[:8] for _ in range(t)]) for _ in range(reps)]
        inputs[t] = x, ids, torch.full((t, 8), 0.125, dtype=torch.bfloat16)
    times = {(t, m): [] for t in rows for m in modes}
    with torch.inference_mode():
        calls = {(t, m): _op_calls(fn, inputs[t][0], inputs[t][1][0], inputs[t][2])
                 for t in rows for m, fn in modes.items()}
        for r in range(rounds + 1):
            for t in rows:
                x, ids, w = inputs[t]
                for mode, fn in modes.items():
                    w0, c0 = time.perf_counter(), time.process_time()
                    for i in range(reps):
                        fn(x, ids[i], w)
                    if r:  # round 0 warms up
                        times[t, mode].append(((time.perf_counter() - w0) / reps * 1e3,
                                               (time.process_time() - c0) / reps * 1e3))
    print("| T | path | ms / block step (wall, median) | CPU ms / step (median) | op calls / step |")
    print("|---|---|---|---|---|")
    for t in rows:
        for mode in modes:
            v = times[t, mode]
            print(f"| {t} | {mode} | {statistics.median(a for a, _ in v):.3f} | "
                  f"{statistics.median(b for _, b in v):.3f} | {calls[t, mode]} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--rows", default="", help="comma-separated T: time one block step of T tokens only")
    ap.add_argument("--max-rows", type=int, default=None, help="with --rows: the op's row bound for this run")
    args = ap.parse_args(argv)

    from moe_decode import build

    from quantspec.models.experts import LinearExperts, experts_modules, linearize_experts
    from quantspec.quant.api import quantize_model
    from quantspec.quant.recipe import Recipe
    from quantspec.runtime.decoder import StaticDecoder

    model = build(args.layers)
    linearize_experts(model)
    recipe = Recipe.from_dict({"method": "rtn", "format": "gptq",
                               "scheme": {"bits": 4, "group_size": 128, "symmetric": True}, "ignore": []})
    model, report = quantize_model(model, recipe)
    blocks = experts_modules(model)
    runners = {n: e.token_runner for n, e in blocks.items()}
    print(f"one-op path on {len(report['cpu_token_experts'])} of {len(blocks)} blocks; "
          f"{torch.get_num_threads()} threads", flush=True)
    if not all(runners.values()):
        return 1
    if args.rows:
        name, experts = next(iter(blocks.items()))
        if args.max_rows is not None:
            runners[name].max_rows = args.max_rows
        _rows_steps(experts, runners[name], [int(t) for t in args.rows.split(",")], args.rounds)
        return 0
    decoder = StaticDecoder(model)
    prompt = torch.randint(3, 32000, (16,), generator=torch.Generator().manual_seed(0))
    inside = [0.0]
    forward = LinearExperts.forward

    def timed(self, *a):
        t0 = time.perf_counter()
        out = forward(self, *a)
        inside[0] += time.perf_counter() - t0
        return out

    LinearExperts.forward = timed
    decode = {False: [], True: []}
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for fast in (False, True):
                for n, e in blocks.items():
                    e.token_runner = runners[n] if fast else None
                ms = _decode_ms(decoder, prompt, args.new, on_start=lambda: inside.__setitem__(0, 0.0))
                if r:  # round 0 warms up
                    decode[fast].append((ms, inside[0] / args.new * 1e3))
    LinearExperts.forward = forward
    for fast, label in ((False, "per-expert"), (True, "one op")):
        ms = statistics.median(v[0] for v in decode[fast])
        moe = statistics.median(v[1] for v in decode[fast])
        print(f"decode, {label}: {ms:.2f} ms/token, in the experts modules ~{moe:.2f} ms "
              f"(rounds {[round(v[0], 2) for v in decode[fast]]})")

    name, experts = next(iter(blocks.items()))
    experts.token_runner = runners[name]
    modes = _block_modes(experts, runners[name])
    x = torch.randn(1, runners[name].hidden, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    times: dict[str, list[float]] = {m: [] for m in modes}
    reps = 50
    with torch.inference_mode():
        for r in range(args.rounds + 1):
            for mode, fn in modes.items():
                t0 = time.perf_counter()
                for i in range(reps):
                    ids = torch.randperm(len(experts), generator=torch.Generator().manual_seed(i))[:8].view(1, 8)
                    fn(x, ids, torch.full((1, 8), 0.125, dtype=torch.bfloat16))
                if r:
                    times[mode].append((time.perf_counter() - t0) / reps * 1e6)
    for mode, v in times.items():
        print(f"one block, one token, {mode}: {statistics.median(v):.0f} us (rounds {[round(t) for t in v]})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
