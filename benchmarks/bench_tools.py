"""Wall times of the citation tool on the shipped notes, side by side in one run: `tools/pin-and-cite check`,
`mkdocs build` (which renders every note first), and the import time of the tool (`import pin_and_cite.cli`),
each the median (and the best) of --rounds runs in fresh processes, as wall time and as CPU time: user + system
of the child process, the figure to compare where other jobs share the cores (after one unmeasured `check` and
one `mkdocs build`, which fill the parse, compiled-template and highlight caches as any run after an edit finds
them). Also counts the torch modules `check` imported (`python -X importtime`): the citation tool never imports
torch, so a count above 0 fails the run. And a fixed pure-Python loop (ten million additions) timed the same
way: the shared machines this runs on change speed by up to half as much again within minutes (CPU time moves
with wall time), so the commands run in interleaved rounds, each round measuring every one, and the loop says
how fast the machine was; compare runs by their loops.

    .venv/bin/python benchmarks/bench_tools.py [--rounds N] [--json]

`mkdocs build` needs the self-hosted assets: run tools/vendor-assets once.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reference.arguments import add_flag

ROOT = Path(__file__).resolve().parents[1]
PYTHON = ROOT / ".venv" / "bin" / "python"
TARGETS = {"check_s": 0.5, "mkdocs_build_s": 3.0}  # issue 13


def _env() -> dict[str, str]:
    """As a user runs the tool: with Python's bytecode cache (__pycache__), even where the caller turned it off."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'tools'}:{ROOT}"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _timed(cmd: list[str]) -> tuple[float, float, subprocess.CompletedProcess]:
    """(wall seconds, CPU seconds, the finished process) of one run of `cmd` from the repository root; a failed
    run stops the benchmark. The CPU time (user + system) says what the run cost where other jobs share the cores."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        sys.exit(f"bench_tools: {' '.join(cmd)} exited {proc.returncode}: {(proc.stdout + proc.stderr)[-2000:]}")
    return elapsed, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), proc


def torch_modules_in_check() -> int:
    """How many torch modules `check` imports, from -X importtime."""
    proc = _timed([str(PYTHON), "-X", "importtime", "-m", "pin_and_cite", "check"])[2]
    return sum(
        1
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and line.rsplit("|", 1)[-1].strip().split(".")[0] == "torch"
    )


def measure(repeat: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-site-") as site:
        commands = {
            "check": [str(ROOT / "tools" / "pin-and-cite"), "check"],
            "mkdocs_build": [str(PYTHON), "-m", "mkdocs", "build", "--quiet", "--site-dir", site],
            "import": [str(PYTHON), "-c", "import pin_and_cite.cli"],
            "machine_loop": [str(PYTHON), "-c", "s = 0\nfor i in range(10_000_000):\n    s += i"],
        }
        for warm in ("check", "mkdocs_build"):  # fill the caches a run after an edit reads
            _timed(commands[warm])
        rounds = [{name: _timed(cmd) for name, cmd in commands.items()} for _ in range(repeat)]
    for name in commands:
        walls, cpus = [r[name][0] for r in rounds], [r[name][1] for r in rounds]
        figures |= {f"{name}_s": statistics.median(walls), f"{name}_cpu_s": statistics.median(cpus)}
        figures[f"{name}_best_s"] = min(walls)
    figures["torch_modules_in_check"] = torch_modules_in_check()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_flag(
        parser,
        "--rounds",
        "--repeat",
        dest="repeat",
        type=int,
        default=3,
        help="rounds, each running every command once (the median and the best are shown)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = parser.parse_args()
    figures = measure(max(1, args.repeat))
    if args.json:
        print(json.dumps(figures))
        return 1 if figures["torch_modules_in_check"] else 0
    print(f"{'what (median of rounds)':28} {'wall':>10} {'CPU':>8} {'best':>8} {'target':>8}")
    for name, label in (
        ("check", "check"),
        ("mkdocs_build", "mkdocs build"),
        ("import", "import pin_and_cite.cli"),
        ("machine_loop", "machine: 10M-addition loop"),
    ):
        target = f"{TARGETS[name + '_s']}s" if name + "_s" in TARGETS else ""
        print(
            f"{label:28} {figures[name + '_s']:>9.2f}s {figures[name + '_cpu_s']:>7.2f}s "
            f"{figures[name + '_best_s']:>7.2f}s {target:>8}"
        )
    print(f"{'torch modules check imports':28} {figures['torch_modules_in_check']:>10} {'':>8} {'':>8} {0:>8}")
    if figures["torch_modules_in_check"]:
        print("bench_tools: `check` imported torch; the citation tool must not", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
