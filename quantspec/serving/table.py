"""The serve-bench result as a Markdown table: one row per target and load level."""

from __future__ import annotations


def _ms(d: dict, key: str) -> str:
    v = d.get(key)
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}"


def _num(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def serve_rows(result: dict) -> tuple[list[str], list[list[str]]]:
    """(column heads, one row of cells per target and load level): what the Markdown table and
    the HTML page both show."""
    slo = result.get("config", {}).get("slo")
    spec = any(lv.get("engine_metrics", {}).get("speculative")
               for t in result.get("targets", []) for lv in t.get("levels", []))
    head = ["target", "level", "ok", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
            "E2E p50", "E2E p99"] + (["goodput req/s", "good %"] if slo else []) + ["KV max %"] + (
            ["draft accept %", "tokens per step"] if spec else []) + ["ppl"]
    rows = []
    for t in result.get("targets", []):
        ppl = t.get("accuracy", {}).get("ppl", {}).get("ppl")
        status = "" if t.get("status") == "ok" else f" ({t.get('status')})"
        if not t.get("levels"):
            rows.append([t["label"] + status, t.get("error", "-")] + ["-"] * (len(head) - 3) + [_num(ppl, ".3f")])
        for lv in t.get("levels", []):
            em = lv.get("engine_metrics", {})
            kv = em.get("kv_cache_usage_max")
            row = [t["label"] + status, lv["level"], f"{lv['completed']}/{lv['requests']}",
                   _num(lv["request_throughput"]), _num(lv["output_throughput"], ".1f"),
                   _ms(lv["ttft"], "p50_ms"), _ms(lv["ttft"], "p99_ms"), _ms(lv["tpot"], "p50_ms"),
                   _ms(lv["tpot"], "p99_ms"), _ms(lv["e2e"], "p50_ms"), _ms(lv["e2e"], "p99_ms")]
            if slo:
                row += [_num(lv.get("goodput")), _num(None if lv.get("good_fraction") is None
                                                      else 100 * lv["good_fraction"], ".0f")]
            row += [_num(None if kv is None else 100 * kv, ".1f")]
            if spec:  # the engine's counters: accepted / drafted tokens, and tokens per target step
                acc = em.get("speculative") or {}
                rate = acc.get("acceptance_rate")
                row += [_num(None if rate is None else 100 * rate, ".1f"), _num(acc.get("mean_accepted_length"))]
            row += [_num(ppl, ".3f")]
            rows.append(row)
    return head, rows


def serve_markdown(result: dict) -> str:
    slo = result.get("config", {}).get("slo")
    head, rows = serve_rows(result)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    notes = [f"Times in ms. Engine: {result.get('engine', {}).get('name')} {result.get('engine', {}).get('version') or ''}"
             .rstrip() + (f"; SLO {slo}" if slo else "") + f"; status {result.get('status')}."]
    return "\n".join(lines + [""] + notes)
