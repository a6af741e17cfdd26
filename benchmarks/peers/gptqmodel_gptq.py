"""Peer runner (runs in GPTQModel's own venv): GPTQ with GPTQModel (same arguments and output
as llmc_gptq.py).

    GPTQMODEL_CPU_WORKERS=2 python gptqmodel_gptq.py MODEL_DIR DATA.pt --bits 4 --group 128 [--actorder none|group]

``seconds`` is the ``quantize()`` call (the model loaded in float32). Perplexity is measured on
the checkpoint GPTQModel saves, loaded back in float32 with the kernel GPTQModel picks itself
(BACKEND.AUTO; its plain torch kernel takes fp16/bf16 only and, in bf16 on this CPU, needed more
than 20 minutes for the 40 windows).
"""

import argparse
import json
import tempfile
import time

import torch

from peer_common import perplexity


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--actorder", default="default", choices=["default", "none", "group"])
    args = ap.parse_args()
    from gptqmodel import BACKEND, GPTQModel, QuantizeConfig

    data = torch.load(args.data)
    extra = {} if args.actorder == "default" else {"desc_act": args.actorder == "group"}
    cfg = QuantizeConfig(bits=args.bits, group_size=args.group, sym=True, **extra)
    model = GPTQModel.load(args.model, cfg, device="cpu", dtype=torch.float32)
    samples = [{"input_ids": row[None], "attention_mask": torch.ones_like(row)[None]} for row in data["calib"]]
    t0 = time.perf_counter()
    model.quantize(samples, batch_size=1)
    seconds = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as out:
        model.save(out)
        del model
        loaded = GPTQModel.load(out, device="cpu", backend=BACKEND.AUTO, dtype=torch.float32)
        ppl = perplexity(loaded.model, data["eval"])
    settings = {k: getattr(cfg, k, None) for k in ("desc_act", "act_group_aware", "static_groups")}
    print(json.dumps({"seconds": seconds, "ppl": ppl, "settings": settings}))


if __name__ == "__main__":
    main()
