"""Tables of the MoE scale traces (reading_notes/traces/moe_scale_*.json, `python -m reference.measure.scale --model
mixtral-8x7b ... --json`): what a rank holds with expert parallelism and without it, and the stated routing's
imbalance. Their bytes per group are scale_tables.scale_table's and diagrams.chart_sent_per_group's.

The numbers are the trace's: the bytes held are re-checked against the formulas recorded with them
(scale_tables.checked_memory), and the imbalance is recomputed here from the recorded tokens per expert, so
a hand-edited or stale trace stops the build with a one-line error instead of being shown.
"""

from __future__ import annotations

from study.scale_tables import checked_memory, human, sent_per_group
from study.traces import RECORD, TraceError

HELD = {
    "expert_parameters": "expert weights",
    "router_parameters": "router weights",
    "gradients": "gradients",
    "master_weights": "fp32 master weights",
    "optimizer_states": "Adam moments",
}


def _model(trace: dict) -> str:
    return trace["setup"]["model"]["name"]


def checked_routing(trace: dict) -> dict:
    """The trace's routing figures, each recomputed from its tokens per expert."""
    r, ep = trace["routing"], trace["group_sizes"]["ep"]
    counts = r["counts"]
    local = len(counts) // ep
    per_rank = [ep * sum(counts[i * local : (i + 1) * local]) for i in range(ep)]
    pairs = sum(counts)
    again = {
        "pairs": pairs,
        "expert_mean": pairs / len(counts),
        "expert_max": max(counts),
        "expert_min": min(counts),
        "expert_max_over_mean": max(counts) / (pairs / len(counts)),
        "ep_rank_received": per_rank,
        "ep_rank_mean": pairs,
        "busiest_ep_rank_over_mean": max(per_rank) / pairs,
        "quietest_ep_rank_over_mean": min(per_rank) / pairs,
    }
    if pairs != r["tokens"] * r["topk"]:
        raise TraceError(
            f"trace {trace['name']}: {pairs} routed pairs, not {r['tokens']} tokens x top-{r['topk']}; {RECORD}"
        )
    wrong = [key for key, value in again.items() if r.get(key) != value]
    if wrong:
        raise TraceError(
            f"trace {trace['name']}: routing {wrong[0]} is {r.get(wrong[0])!r} but its tokens per expert give "
            f"{again[wrong[0]]!r}; {RECORD}"
        )
    return r


def moe_memory_table(*traces: dict) -> str:
    """Markdown: per held kind, what each trace's first traced rank holds with EP (traced, checked) and without
    it (the formula at EP 1: every expert on every rank)."""
    header = "| held | " + " | ".join(
        f"{_model(t)}, EP {t['group_sizes']['ep']} (traced) | {_model(t)}, EP 1" for t in traces
    )
    lines = [header + " |", "|---|" + "---:|---:|" * len(traces)]
    held = [(checked_memory(t, t["runs"][0]), t["runs"][0]["memory"]["without_ep"]) for t in traces]
    for what, label in HELD.items():
        lines.append(f"| {label} | " + " | ".join(f"{human(a[what])} | {human(b[what])}" for a, b in held) + " |")
    lines.append(
        "| **total** | "
        + " | ".join(f"**{human(sum(a.values()))}** | {human(sum(b.values()))}" for a, b in held)
        + " |"
    )
    return "\n".join(lines) + "\n"


def moe_imbalance_table(*traces: dict) -> str:
    """Markdown: per trace, the stated routing (checked) and what it does to the busiest and quietest EP rank."""
    lines = [
        "| model | Zipf skew | pairs per rank (T x k) | per expert: mean / max / min | max / mean | "
        "busiest EP rank receives (/ mean) | quietest (/ mean) | EP bytes sent per step: busiest / quietest traced |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for trace in traces:
        r = checked_routing(trace)
        busiest, quietest = max(r["ep_rank_received"]), min(r["ep_rank_received"])
        sent = [sent_per_group(trace, run)["ep"] for run in trace["runs"]]
        lines.append(
            f"| {_model(trace)} | {r['skew']:g} | {r['tokens']:,} x {r['topk']} = {r['pairs']:,} | "
            f"{r['expert_mean']:g} / {r['expert_max']} / {r['expert_min']} | {r['expert_max_over_mean']:.2f} | "
            f"{busiest:,} ({r['busiest_ep_rank_over_mean']:.2f}) | "
            f"{quietest:,} ({r['quietest_ep_rank_over_mean']:.2f}) | "
            f"{human(max(sent))} / {human(min(sent))} |"
        )
    return "\n".join(lines) + "\n"
