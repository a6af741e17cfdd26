"""GPTQ's Hessian products in float32 or bfloat16 (``gptq.hessian_dtype``), side by side on a
validation split: ``gptq_options.py --option hessian_dtype --values float32,bfloat16`` (its
protocol), writing results/gptq-hessian-dtype-MODEL.

    python benchmarks/gptq_hessian_dtype.py --model smollm2-135m --configs nvfp4,mxfp4 --seeds 0,1,2
    python benchmarks/gptq_hessian_dtype.py --model qwen2.5-coder-0.5b --configs nvfp4 --seeds 0,1
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gptq_options import main  # noqa: E402

if __name__ == "__main__":
    main(["--option", "hessian_dtype", "--values", "float32,bfloat16", *sys.argv[1:]], script="gptq_hessian_dtype.py")
