"""Tables of a scale trace (reading_notes/traces/scale_*.json, `python -m reference.measure.scale --json`): bytes per
step per process group and collective type, for a first, middle and last pipeline stage rank of a large job.

The measured numbers and the formulas' terms both come from the trace: reference.measure.scale.formulas computed the
terms when the trace was recorded (tests/reference/test_scale.py traces afresh and compares), so the site
never imports the reference or torch. A row that disagrees with its terms (a hand-edited or stale trace) stops
the build with a one-line error instead of being shown.
"""

from __future__ import annotations

from study.traces import RECORD, TraceError

GROUPS = {"tp": "TP", "pp": "PP", "dp": "DP"}
HSDP_GROUPS = {"dp_shard": "DP shard", "dp_replicate": "DP replicate"}  # HSDP's two groups inside the DP group
RING = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # x (p-1)/p of the full tensor, sent per rank


def sent_bytes(op: str, nbytes: int, group_size: int) -> int:
    """Bytes one rank sends for a collective under ring algorithms (the convention of
    study.estimates): all-reduce 2(p-1)/p N, all-gather and reduce-scatter (p-1)/p N, send N, recv 0."""
    if op in RING:
        return RING[op] * (group_size - 1) * nbytes // group_size
    return nbytes if op == "send" else 0


def groups_of(trace: dict) -> dict[str, str]:
    """{group: its name in a table} of a trace: TP, PP and DP, and HSDP's two groups where it has them; or the
    trace's own (a MoE trace's EP and expert-DP groups)."""
    if "groups" in trace:
        return trace["groups"]
    seen = {row["group"] for run in trace["runs"] for row in run["rows"]}
    return GROUPS | {g: name for g, name in HSDP_GROUPS.items() if g in seen}


def group_size(trace: dict, group: str) -> int:
    """Ranks in a group of this kind: the setup's tp, pp, dp, or under HSDP dp / replicas and the replicas; or
    the trace's own sizes (a MoE trace's)."""
    setup = trace["setup"]
    if "group_sizes" in trace:
        return trace["group_sizes"][group]
    replicas = setup.get("dp_replicate", 1)
    return {"dp_shard": setup["dp"] // replicas, "dp_replicate": replicas}.get(group) or setup[group]


def sent_per_group(trace: dict, run: dict) -> dict[str, int]:
    """{group: bytes this rank sends in one step}, ring algorithms; an all-to-all's from its formula terms
    (what leaves the rank depends on the split sizes, which only the formulas know)."""
    terms = {(f["group"], f["op"]): f["terms"] for f in run.get("formulas", [])}
    out = dict.fromkeys(groups_of(trace), 0)
    for row in run["rows"]:
        if row["op"] == "all_to_all":
            sent = [t.get("sent") for t in terms.get((row["group"], row["op"]), [])]
            if not sent or None in sent:
                raise TraceError(
                    f"trace {trace['name']}: rank {run['rank']}'s all-to-all lacks its bytes sent; {RECORD}"
                )
            out[row["group"]] += sum(sent)
        else:
            out[row["group"]] += sent_bytes(row["op"], row["bytes"], group_size(trace, row["group"]))
    return out


def stage_name(stage: int, stages: int) -> str:
    where = "first" if stage == 0 else "last" if stage == stages - 1 else "middle"
    return f"{stage} ({where})" if stages > 1 else "0 (only)"


def run_name(trace: dict, run: dict) -> str:
    """How the tables name a traced rank: its stage, or the label a MoE trace gives it."""
    return run.get("label") or stage_name(run["stage"], trace["setup"]["pp"])


def human(nbytes: int) -> str:
    """Bytes for a table: 2 decimals of the largest binary unit (as `python -m reference.measure.scale` prints them)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes} B"


def totals(terms: list[dict]) -> tuple[int, int]:
    """(count, bytes) of a row's formula terms."""
    return sum(t["count"] for t in terms), sum(t["nbytes"] for t in terms)


def checked_runs(trace: dict) -> list[tuple[dict, list[tuple[dict, list[dict]]]]]:
    """Per run, each measured row with the formula's terms recorded beside it, every row re-checked."""
    runs = []
    for run in trace["runs"]:
        if "formulas" not in run:
            raise TraceError(f"trace {trace['name']}: rank {run['rank']} lacks the formulas' terms; {RECORD}")
        predicted = {(f["group"], f["op"]): f["terms"] for f in run["formulas"]}
        rows = []
        for row in run["rows"]:
            terms = predicted.pop((row["group"], row["op"]), [])
            if (row["count"], row["bytes"]) != totals(terms):
                count, nbytes = totals(terms)
                raise TraceError(
                    f"trace {trace['name']}: rank {run['rank']} {row['group']} {row['op']} recorded "
                    f"{row['count']} x / {row['bytes']} B but reference.measure.scale.formulas gives "
                    f"{count} x / {nbytes} B; {RECORD}"
                )
            rows.append((row, terms))
        if predicted:
            group, op = next(iter(predicted))
            raise TraceError(
                f"trace {trace['name']}: rank {run['rank']} recorded no {group} {op}, which "
                f"reference.measure.scale.formulas predicts; {RECORD}"
            )
        runs.append((run, rows))
    return runs


def scale_table(trace: dict) -> str:
    """Markdown: per stage and group, the collectives' bytes and what the rank sends (ring); then every
    (group, collective) row with its formula."""
    runs, groups = checked_runs(trace), groups_of(trace)
    who = "traced rank" if "groups" in trace else "stage"
    totals = [
        f"| {who} ({'global rank' if 'groups' in trace else 'rank'}) | "
        + " | ".join(f"{g}: collective bytes / sent by the rank" for g in groups.values())
        + " |",
        "|---|" + "---:|" * len(groups),
    ]
    detail = [
        f"| {who} | group | collective | count | bytes | formula (checked at render) |",
        "|---|---|---|---:|---:|---|",
    ]
    for run, rows in runs:
        where = run_name(trace, run)
        per_group = {g: sum(r["bytes"] for r, _ in rows if r["group"] == g) for g in groups}
        sent = sent_per_group(trace, run)
        totals.append(
            f"| {where} (rank {run['rank']}) | "
            + " | ".join(f"{human(per_group[g])} / {human(sent[g])}" if per_group[g] else "—" for g in groups)
            + " |"
        )
        for row, terms in rows:
            formula = " + ".join(t["formula"] for t in terms)
            detail.append(
                f"| {where} | {groups.get(row['group'], row['group'])} | {row['op']} | {row['count']} | "
                f"{human(row['bytes'])} | {formula} |"
            )
    return "\n".join(totals) + "\n\n" + "\n".join(detail) + "\n"


HELD = {
    "parameters": "parameters",
    "gradients": "gradients",
    "master_weights": "fp32 master weights",
    "optimizer_states": "Adam moments",
}


def checked_memory(trace: dict, run: dict) -> dict[str, int]:
    """The bytes a traced rank holds, each re-checked against reference.measure.scale.formulas.memory as recorded."""
    memory = run.get("memory")
    if memory is None:
        raise TraceError(f"trace {trace['name']}: rank {run['rank']} lacks the bytes it holds; {RECORD}")
    for what, nbytes in memory["measured"].items():
        if memory["formula"].get(what) != nbytes:
            raise TraceError(
                f"trace {trace['name']}: rank {run['rank']} holds {nbytes} B of {what} but "
                f"reference.measure.scale.formulas gives {memory['formula'].get(what)} B; {RECORD}"
            )
    return memory["measured"]


def memory_table(replicated: dict, sharded: dict) -> str:
    """Markdown: per stage, what a rank holds with every DP rank stepping every parameter (`replicated`) and
    with the distributed optimizer (`sharded`), two traces of the same layout."""
    lines = [
        "| stage (rank) | held | every DP rank steps all | distributed optimizer | ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for whole, sliced in zip(replicated["runs"], sharded["runs"]):
        where = f"{stage_name(whole['stage'], replicated['setup']['pp'])} (rank {whole['rank']})"
        a, b = checked_memory(replicated, whole), checked_memory(sharded, sliced)
        for what, label in HELD.items():
            lines.append(
                f"| {where} | {label} | {human(a[what])} | {human(b[what])} | {b[what] / a[what]:.3f} |"
                if a[what]
                else f"| {where} | {label} | 0 B | 0 B | — |"
            )
        total_a, total_b = sum(a.values()), sum(b.values())
        lines.append(f"| {where} | **total** | {human(total_a)} | {human(total_b)} | {total_b / total_a:.3f} |")
    return "\n".join(lines) + "\n"


def sharding_name(setup: dict) -> str:
    """How a trace shards over DP, for a column heading: FSDP2 over dp ranks, or HSDP's replicas x shards."""
    replicas, dp = setup.get("dp_replicate", 1), setup["dp"]
    return f"HSDP, {replicas} x {dp // replicas}" if replicas > 1 else f"FSDP2 over {dp}"


def held_table(*traces: dict) -> str:
    """Markdown: what the traced rank of each trace (one pipeline stage: FSDP2, HSDP) holds, side by side, each
    number re-checked against reference.measure.scale.formulas.memory as recorded."""
    held = [checked_memory(trace, trace["runs"][0]) for trace in traces]
    lines = [
        "| held | " + " | ".join(sharding_name(t["setup"]) + f" (rank {t['runs'][0]['rank']})" for t in traces) + " |",
        "|---|" + "---:|" * len(traces),
    ]
    for what, label in HELD.items():
        lines.append(f"| {label} | " + " | ".join(human(h[what]) for h in held) + " |")
    lines.append("| **total** | " + " | ".join(human(sum(h.values())) for h in held) + " |")
    return "\n".join(lines) + "\n"
