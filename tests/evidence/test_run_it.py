"""Every Run it block of every walkthrough prints what its page shows.

One block of each program at each world size runs as a reader runs it (study.run_it.run_block: from the
project root, the venv not activated, a torchrun of its own), a few at once; the other blocks of
`torchrun -m reference` run inside the suite's launch of that world size (tests/ranks.py: the demo's main on
the launch's group, as torchrun would start it), which spares each its own start of torch on every rank.
Either way the stdout is compared with the recording the page renders (reading_notes/runs/NAME.txt). Only what
must vary between runs is normalized: wall-clock figures (a step's time, a stage's measured bubble) and the CPU
cores they were measured on.
"""

from __future__ import annotations

import re
import shlex
from concurrent.futures import ThreadPoolExecutor

import pytest

from study.note_rules import walkthrough_runs
from study.run_it import plain_shell_env, read_recording, run_block
from tests.ranks import on_ranks
from tests.reference.helpers import demo_output
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


DEMO = re.compile(r"\.venv/bin/torchrun --standalone --nproc-per-node (\d+) -m reference (.*)")


def demo_runs(block) -> tuple[int, list[list[str]]] | None:
    """(world size, each command's demo arguments) of a block whose commands all run `torchrun -m reference` on
    one world size, else None; `--device` left to the launch (helpers.demo_output)."""
    found = [DEMO.fullmatch(command) for command in block.commands]
    if not all(found) or len({m[1] for m in found}) != 1:
        return None
    argvs = [shlex.split(m[2]) for m in found]
    for argv in argvs:
        if "--device" in argv:
            del argv[argv.index("--device") : argv.index("--device") + 2]
    return int(found[0][1]), argvs


def programs(block) -> set[tuple[str, int]]:
    """What a plain-shell run of the block proves works as written: each program it runs, at its world size."""
    return {
        (re.search(r"-m (\S+)", command)[1], int((re.search(r"--nproc-per-node (\d+)", command) or [0, 1])[1]))
        for command in block.commands
    }


BLOCKS = [block for _, block in walkthrough_runs(NOTES)]
PLAIN, IN_LAUNCH, shown = [], {}, set()
for _block in BLOCKS:
    if programs(_block) <= shown and (runs := demo_runs(_block)):
        IN_LAUNCH.setdefault(runs[0], []).append(_block)
    else:
        PLAIN.append(_block)
        shown |= programs(_block)


def assert_prints_what_its_page_shows(block, output: str) -> None:
    commands, recorded = read_recording(NOTES, block.recording)
    assert commands == block.commands, f"runs/{block.recording}.txt: re-record it with tools/record-runs"
    if normalized(output) != normalized(recorded):
        pytest.fail(
            f"runs/{block.recording}.txt differs from a fresh run of its commands (re-record with "
            f"tools/record-runs if the change is meant):\n--- recorded\n{recorded}\n--- fresh\n{output}"
        )


def test_every_block_runs_in_a_plain_shell_or_in_a_launch():
    assert {b.recording for b in PLAIN} | {b.recording for bs in IN_LAUNCH.values() for b in bs} == {
        b.recording for b in BLOCKS
    }
    assert len(PLAIN) < len(BLOCKS) / 2 and set(IN_LAUNCH) <= {1, 2, 4}
    assert set().union(*map(programs, PLAIN)) == set().union(*map(programs, BLOCKS))  # each one, as written


@pytest.mark.freshness
def test_every_run_it_block_prints_what_its_page_shows():
    """One block of each program at each world size, in a plain shell; the others are below."""
    with ThreadPoolExecutor(max_workers=min(len(PLAIN), AT_ONCE)) as pool:
        fresh = list(pool.map(lambda block: run_block(ROOT, block, TIMEOUT_S), PLAIN))
    for block, output in zip(PLAIN, fresh):
        assert_prints_what_its_page_shows(block, output)


def _in_launch(world: int):
    blocks = IN_LAUNCH.get(world, [])

    @pytest.mark.freshness
    @on_ranks(world, timeout_s=TIMEOUT_S)
    @pytest.mark.parametrize("recording", [b.recording for b in blocks])
    def test_the_run_it_block_prints_what_its_page_shows_in_the_launch(ranks, recording):
        [block] = [b for b in blocks if b.recording == recording]
        assert_prints_what_its_page_shows(block, "".join(demo_output(argv) for argv in demo_runs(block)[1]))

    return test_the_run_it_block_prints_what_its_page_shows_in_the_launch


test_the_run_it_blocks_at_2_ranks = _in_launch(2)
test_the_run_it_blocks_at_4_ranks = _in_launch(4)
