"""Every Run it block of every walkthrough prints what its page shows.

The blocks run as a reader runs them (study.run_it.run_block: from the project root, the venv
not activated), all at once, and their stdout is compared with the recording the page renders
(reading_notes/runs/NAME.txt). Only what must vary between runs is normalized: wall-clock figures (a step's time,
a stage's measured bubble) and the CPU cores they were measured on.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

from study.note_rules import walkthrough_runs
from study.run_it import plain_shell_env, read_recording, run_block
from tests.site.conftest import ROOT

NOTES = ROOT / "reading_notes"
TIMEOUT_S = 300
# Demos at once: each is 2 to 4 torchrun ranks; a dozen jobs together on a 2-core machine would only contend
# for the cores (and 24 GiB) and crowd the block timeouts, while a few keep both cores busy during start-ups.
AT_ONCE = 3
# (pattern, replacement): the step's wall-clock time, "(467.9 ms wall clock)", and, at pp > 1, the bubble
# measured by wall clock ("wall clock 0.54") and the machine it was measured on ("4 ranks on 2 CPU cores, which
# they take turns on": the cores this machine lets the run use); the modeled bubbles are the schedule's and stay.
VARIES = (
    (re.compile(r"\(\d+(?:\.\d+)? ms wall clock\)"), "(<wall clock> ms)"),
    (re.compile(r"wall clock \d+\.\d+"), "wall clock <wall clock>"),
    (re.compile(r"(\d+ ranks?) on \d+ CPU cores(?:, which they take turns on)?;"), r"\1 on <cores> CPU cores;"),
)


def normalized(output: str) -> str:
    for pattern, replacement in VARIES:
        output = pattern.sub(replacement, output)
    return output


def test_the_normalization_hides_only_the_wall_clock():
    line = "step 0: loss 4.865125 (467.9 ms wall clock) | tp: all_reduce x52 (329216 B)"
    assert normalized(line) == "step 0: loss 4.865125 (<wall clock> ms) | tp: all_reduce x52 (329216 B)"
    assert normalized(line) != normalized(line.replace("x52", "x51").replace("4.865125", "4.865126"))
    bubble = "expected 4); bubble 0.27 with equal stages, 0.35 at its FLOPs, wall clock 0.54"
    assert (
        normalized(bubble) == "expected 4); bubble 0.27 with equal stages, 0.35 at its FLOPs, wall clock <wall clock>"
    )
    assert normalized(bubble) != normalized(bubble.replace("0.27", "0.28").replace("0.35", "0.36"))
    machine = "  wall clock: this run's, 4 ranks on 2 CPU cores, which they take turns on; sends, receives"
    assert normalized(machine) == normalized(machine.replace("2 CPU cores, which they take turns on", "16 CPU cores"))
    assert normalized(machine) != normalized(machine.replace("4 ranks", "2 ranks"))


def test_a_reader_shell_has_no_venv(monkeypatch):
    """The commands must work as written in a fresh shell: `.venv/bin/torchrun`, never a bare `torchrun`."""
    venv = str(ROOT / ".venv")
    monkeypatch.setenv("VIRTUAL_ENV", venv)
    monkeypatch.setenv("PATH", f"{venv}/bin:/usr/bin:/bin")
    env = plain_shell_env()
    assert "VIRTUAL_ENV" not in env and env["PATH"] == "/usr/bin:/bin"


def test_every_walkthrough_has_a_run_it_block():
    runs = walkthrough_runs(NOTES)
    assert {template.name for template, _ in runs} >= {"walkthrough-tp.md.j2"}
    assert all(block.recording for _, block in runs)


@pytest.mark.freshness
def test_every_run_it_block_prints_what_its_page_shows():
    runs = [block for _, block in walkthrough_runs(NOTES)]
    with ThreadPoolExecutor(max_workers=min(len(runs), AT_ONCE)) as pool:
        fresh = list(pool.map(lambda block: run_block(ROOT, block, TIMEOUT_S), runs))
    for block, output in zip(runs, fresh):
        commands, recorded = read_recording(NOTES, block.recording)
        assert commands == block.commands, f"runs/{block.recording}.txt: re-record it with tools/record-runs"
        if normalized(output) != normalized(recorded):
            pytest.fail(
                f"runs/{block.recording}.txt differs from a fresh run of its commands (re-record with "
                f"tools/record-runs if the change is meant):\n--- recorded\n{recorded}\n--- fresh\n{output}"
            )
