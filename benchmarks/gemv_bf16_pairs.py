"""Would bf16x2 pair arithmetic keep the packed GEMV within its error bound for bf16 x? (issue 33)

A numpy emulation of the packed GEMV's order (wq_gemv_packed.py, GPTQ layout: a word's 8 rows as the
pairs (k+i, k+i+4), ``words`` words a partial, then fp32) with each lane's partial sum kept in bf16 by
``fma.rn.bf16x2`` (one rounding a product, the weight code - zero exact in bf16), against the fp32
order the kernel keeps (exact products, fp32 sums). The metric is the tests' and
docs/decisions/packed-gemv.md's: ``max |y - y_ref| / max(1, max |y_ref|)`` as a fraction of the bf16
tolerance 1.6e-2, worst of 3 seeds and of W4 g128 sym / asym, N = 512; ``out``: after the bf16
output rounding (y_ref: the fp32 product rounded to bf16, as the reference backend), ``acc``: the
sum alone, before that rounding, against the exact product.

    python benchmarks/gemv_bf16_pairs.py            # writes benchmarks/results/gemv-bf16-pairs.{json,md}
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

from quantspec.core.scheme import QuantScheme
from quantspec.quant.rtn import rtn

RESULTS = Path(__file__).resolve().parent / "results"
TOL_BF16 = 1.6e-2
GROUP = 128


def round_bf16(v: np.ndarray) -> np.ndarray:
    """Round float64 values to bf16 (8 significant bits), to nearest even."""
    m, e = np.frexp(v)
    return np.ldexp(np.round(m * 256.0) / 256.0, e)  # np.round: half to even


def activations(kind: str, k: int, g: torch.Generator) -> np.ndarray:
    """bf16 x [K] as float64: randn, outliers (1 channel in 256 x 30-100), Student t (3), randn x 200."""
    x = torch.randn(k, generator=g)
    if kind == "outliers":
        idx = torch.randperm(k, generator=g)[: k // 256]
        x[idx] *= 30 + 70 * torch.rand(len(idx), generator=g)
    elif kind == "t3":
        x = torch.distributions.StudentT(3.0).sample((k,))
    elif kind == "x200":
        x = x * 200
    return x.bfloat16().double().numpy()


def gemv(x: np.ndarray, w: np.ndarray, s: np.ndarray, words: int | None) -> np.ndarray:
    """x [K] . W [K, N] (W = code - zero, s [K // GROUP, N] scales) in the packed GEMV's order:
    ``words`` words a partial in bf16 lanes (None: fp32 fmas of exact products, the kernel's)."""
    k, n = w.shape
    acc = np.zeros(n, np.float32)
    per = words or 4
    for c0 in range(0, k // 8, per):
        if words is None:
            h = np.zeros(n, np.float32)
            for wd in range(c0, c0 + per):
                for i in (0, 4, 1, 5, 2, 6, 3, 7):
                    h = (x[8 * wd + i] * w[8 * wd + i] + h.astype(np.float64)).astype(np.float32)
            part = h
        else:
            lo, hi = np.zeros(n), np.zeros(n)
            for wd in range(c0, c0 + per):
                for i in range(4):
                    lo = round_bf16(x[8 * wd + i] * w[8 * wd + i] + lo)
                    hi = round_bf16(x[8 * wd + i + 4] * w[8 * wd + i + 4] + hi)
            part = (lo + hi).astype(np.float32)
        acc = (acc + part * s[8 * c0 // GROUP].astype(np.float32)).astype(np.float32)
    return acc.astype(np.float64)


def measure(kind: str, k: int, words: int | None, n: int, seeds: int) -> dict:
    out = acc = 0.0
    for sym in (True, False):
        for seed in range(seeds):
            g = torch.Generator().manual_seed(seed)
            r = rtn(torch.randn(n, k, generator=g), QuantScheme(4, GROUP, sym))
            codes = r.qweight.double().numpy().T  # [K, N]
            s = r.scales.double().numpy().T  # [G, N]
            z = np.full_like(s, 8.0) if r.zeros is None else r.zeros.double().numpy().T
            rows = np.arange(k) // GROUP
            w = codes - z[rows]
            x = activations(kind, k, g)
            exact = x @ (w * s[rows])
            y_ref = torch.tensor(exact).float().bfloat16().double().numpy()
            y = gemv(x, w, s, words)
            acc = max(acc, np.abs(y - exact).max() / max(1.0, np.abs(exact).max()) / TOL_BF16)
            y = torch.tensor(y).float().bfloat16().double().numpy()
            out = max(out, np.abs(y - y_ref).max() / max(1.0, np.abs(y_ref).max()) / TOL_BF16)
    return {"out": round(float(out), 3), "acc": round(float(acc), 3)}


def markdown(result: dict) -> str:
    cols = result["words"]
    head = " | ".join(("fp32 (kernel)" if c is None else f"bf16 {c} w") for c in cols)
    lines = [f"# bf16x2 partial sums in the packed GEMV, emulated: {result['date']}", "",
             (f"Command: `{result['command']}`. Raw data: gemv-bf16-pairs.json. Fraction of the bf16 TOL "
             "(1.6e-2 of max(1, max |y_ref|)), worst of 3 seeds and W4 g128 sym / asym, N = 512; each cell "
             "`out / acc`: after the bf16 output rounding / the sum before it, against the exact product. "
             "`bf16 c w`: c words (4c products a lane) a bf16 partial; fp32: the kernel's order."), "",
             f"| x | K | {head} |", "|---|---:|" + "---:|" * len(cols)]
    for row in result["rows"]:
        cells = " | ".join(f"{row[str(c)]['out']} / {row[str(c)]['acc']}" for c in cols)
        lines.append(f"| {row['x']} | {row['k']} | {cells} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="1024,4096")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.manual_seed(0)  # Student t sampling draws from the global generator
    words = [1, 2, 4, 8, None]
    rows = []
    for kind in ("randn", "outliers", "t3", "x200"):
        for k in (int(v) for v in args.ks.split(",")):
            row = {"x": kind, "k": k}
            for c in words:
                row[str(c)] = measure(kind, k, c, args.n, args.seeds)
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "words": words, "rows": rows,
              "command": "python benchmarks/gemv_bf16_pairs.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gemv-bf16-pairs.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "gemv-bf16-pairs.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
