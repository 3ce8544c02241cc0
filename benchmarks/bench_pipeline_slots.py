"""How the site's pipeline timeline scales with the stages: the seconds `pipeline_slots` (tools/study/
traces.py) takes to place one forward and one backward on each of p stages, p doubling. Each action waits on one
action of a neighbouring stage, so the time per stage stays flat; a placement that rescanned every stage per
action grew with p (12,000 stages once took 268 s). Best of --rounds runs per p.

    .venv/bin/python benchmarks/bench_pipeline_slots.py [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from study.traces import pipeline_slots

STAGES = [1000, 2000, 4000, 8000]


def seconds(p: int, rounds: int) -> float:
    trace = {"name": "wide", "stages": [{"actions": ["F0", "B0"]} for _ in range(p)]}
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        pipeline_slots(trace)
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_pipeline_slots", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, choices=range(1, 101), metavar="N", help="runs per p (1-100)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args(argv)
    rows = [{"stages": p, "seconds": seconds(p, args.rounds)} for p in STAGES]
    for row in rows:
        row["us_per_stage"] = 1e6 * row["seconds"] / row["stages"]
    if args.json:
        print(json.dumps({"rounds": args.rounds, "rows": rows}))
        return 0
    print(f"{'stages':>8} {'seconds':>10} {'us / stage':>11}")
    for row in rows:
        print(f"{row['stages']:>8} {row['seconds']:>10.4f} {row['us_per_stage']:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
