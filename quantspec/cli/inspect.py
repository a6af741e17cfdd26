"""``quantspec inspect DIR``: what a checkpoint holds and how it will run here."""

from __future__ import annotations

from collections import Counter

from ._common import write_json


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="describe a quantized checkpoint")
    p.add_argument("path")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--json")
    p.set_defaults(func=run)


def _later(layer: dict) -> tuple:
    """(name, reason) of the backends after the chosen one, the reference left out."""
    names = list(layer.get("backends", {}))
    if layer["backend"] not in names:
        return ()
    after = names[names.index(layer["backend"]) + 1:]
    return tuple((n, layer["backends"][n]) for n in after if n != "reference")


def run(args) -> int:
    from ..checkpoint.inspect import inspect_checkpoint

    info = inspect_checkpoint(args.path, device=args.device, dtype=args.dtype)
    s = info["scheme"]
    print(f"{info['path']}: {info['format']} format, model_type {info['model_type']}, "
          f"{info['size_bytes'] / 1e6:.1f} MB of weights")
    number = f"{s['weights']} ({s['bits']}-bit float)" if s.get("weights") else f"{s['bits']}-bit"
    print(f"scheme: {number}, group {s['group_size']}, "
          f"{'symmetric' if s['symmetric'] else 'asymmetric'}"
          f"{', act-order' if s['act_order'] else ''}"
          f"{', activations ' + s['activations'] if s.get('activations') else ''}")
    quant = {n: v for n, v in info["layers"].items() if not v.get("dense")}
    kinds = Counter((v["scheme"], v["backend"], v.get("backend_reason", ""), _later(v)) for v in quant.values())
    for (scheme, backend, why, later), n in sorted(kinds.items()):
        print(f"  {n:4d} layers: {scheme} -> backend {backend}")
        if why and why not in ("fastest available", "requested"):  # the faster backends passed over, and why
            for skipped in why.split("; "):
                print(f"         not {skipped}")
        for name, reason in later:  # the slower ones (or not measured faster), and whether they run
            print(f"         then {name}: {reason or 'can run (--backend ' + name + ')'}")
    for name, e in info["experts"].items():
        left = f", dense: experts {e['dense_experts']}" if e["dense_experts"] else ""
        print(f"  {name}: {e['quantized']} of {e['experts']} experts quantized{left}")
    kv = info["kv_cache"]
    if kv:
        print(f"  KV cache: {kv['kind']}, scales per {kv['strategy']} in {kv['layers']} layers "
              f"(k_scale {kv['min_k_scale']:.4g}..{kv['max_k_scale']:.4g}, "
              f"v_scale {kv['min_v_scale']:.4g}..{kv['max_v_scale']:.4g})")
    for name in info["dense_layers"]:
        print(f"  dense: {name} ({info['layers'][name]['reason']})")
    if args.json:
        write_json(args.json, info)
    return 0
