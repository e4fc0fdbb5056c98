"""The table ``lynx demo`` prints (``tools/demo.py``): one row per variant, what it ran, and a
failed row's result short enough for a cell."""
from __future__ import annotations

from typing import Sequence

from lynx_compile.budget import named_fraction
from lynx_compile.tools.report import human_bytes
from lynx_compile.tools.variants import describe, parse_variant

TABLE_COLUMNS = ["variant", "what", "step_ms", "peak", "peak_vs_compile", "peak_vs_eager", "predicted_peak",
                 "grads_equal_eager", "grad_rel_diff", "first_step_s"]


def table_rows(rows: Sequence[dict]) -> list[dict]:
    """The rows as the printed table shows them. ``peak_vs_compile``: of torch.compile's own
    step (the ``inductor`` row), what a lynx ``memory_budget`` fraction is of."""
    eager_peak = next((r.get("peak_MiB") for r in rows if r["variant"] == "eager" and r["result"] == "ok"), None)
    compile_peak = next((r.get("peak_MiB") for r in rows if r["variant"] == "inductor" and r["result"] == "ok"),
                        None)
    out = []
    for r in rows:
        ok = r["result"] == "ok"
        peak = r.get("peak_MiB")
        predicted = r.get("predicted_peak_MiB")
        out.append({
            "variant": r["variant"], "what": what(r),
            "step_ms": round(r["step_ms"], 1) if ok else short_result(r),
            "peak": human_bytes(peak * 2**20) if ok else "-",
            "peak_vs_compile": round(peak / compile_peak, 3) if ok and compile_peak else None,
            "peak_vs_eager": round(peak / eager_peak, 3) if ok and eager_peak else None,
            "predicted_peak": human_bytes(predicted * 2**20) if predicted is not None and ok else "-",
            "grads_equal_eager": "yes" if r["grads_equal_eager"] else "- (did not run)" if not ok
            else f"no: {r['why_not_equal']}",
            "grad_rel_diff": f"{r['grad_rel_diff']:.1e}" if r.get("grad_rel_diff") is not None and ok else "-",
            "first_step_s": round(r["first_step_s"], 1) if r.get("first_step_s") is not None else None,
        })
    return out


def conclusion(rows: Sequence[dict]) -> list[str]:
    """What the table supports, in a few lines: for each peer that ran (eager, checkpoint,
    torch.compile at its budgets), the fastest lynx row whose measured peak is no higher, and its
    step time as a multiple of the peer's; then the lowest peak lynx measured against the lowest
    of the peers. Nothing where no lynx row ran."""
    ran = [r for r in rows if r["result"] == "ok" and r.get("peak_MiB") is not None]
    lynx = [r for r in ran if parse_variant(r["variant"]).kind == "lynx"]
    peers = [r for r in ran if parse_variant(r["variant"]).kind != "lynx"]
    if not lynx or not peers:
        return []

    def peak(r: dict) -> str:
        return human_bytes(r["peak_MiB"] * 2**20)

    lines = []
    for p in peers:
        fits = [r for r in lynx if r["peak_MiB"] <= p["peak_MiB"]]
        if not fits:
            lines.append(f"- at {p['variant']}'s memory ({peak(p)}): no lynx row fits in it")
            continue
        best = min(fits, key=lambda r: r["step_ms"])
        ratio = best["step_ms"] / p["step_ms"]
        lines.append(f"- at no more memory than {p['variant']} ({peak(p)}): "
                     f"{best['variant']} ({peak(best)}) takes {ratio:.2f}x its step time "
                     f"({'faster' if ratio < 1 else 'slower' if ratio > 1 else 'the same'})")
    low, low_peer = min(lynx, key=lambda r: r["peak_MiB"]), min(peers, key=lambda r: r["peak_MiB"])
    if low["peak_MiB"] < low_peer["peak_MiB"]:
        lines.append(f"- lowest memory: {low['variant']} at {peak(low)}, "
                     f"{low['peak_MiB'] / low_peer['peak_MiB']:.2f}x the lowest of the others "
                     f"({low_peer['variant']}, {peak(low_peer)}), at "
                     f"{low['step_ms'] / low_peer['step_ms']:.2f}x its step time")
    else:
        lines.append(f"- lowest memory: {low_peer['variant']} ({peak(low_peer)}); "
                     f"lynx's lowest is {low['variant']} at {peak(low)}")
    return ["What this table shows (measured, this machine):", *lines]


def what(row: dict) -> str:
    """``describe`` of the variant, saying when it was compiled per block."""
    text = describe(row["variant"])
    if row.get("style") == "per-block" and parse_variant(row["variant"]).kind in ("inductor", "lynx"):
        text = text.replace("torch.compile", "torch.compile per block", 1) if text.startswith("torch.compile") \
            else text.replace("lynx", "lynx per block", 1)
    return text


def short_result(row: dict) -> str:
    """A failed row's result, short enough for a table cell: a refusal with the smallest
    reachable budget lynx named (``refused (reachable >= 0.188)``), an error's first 60 characters."""
    result = row["result"]
    if result.startswith("refused"):
        named = named_fraction(result)  # written with 3 decimals (Budget.at_least): shown as written
        return f"refused (reachable >= {named:.3f})" if named is not None else "refused"
    return result if len(result) <= 60 else result[:57] + "..."
