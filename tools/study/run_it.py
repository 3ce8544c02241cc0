"""Run it blocks: the commands a walkthrough asks a reader to run, and the output it shows beside them.

A Run it block is a fenced block whose info string holds `run-it` (` ```{ .shell .run-it } `), followed by
`{{ run_output("NAME") }}`, which shows reading_notes/runs/NAME.txt: the block's commands (`$ ` lines), then
what they printed on stdout. tools/record-runs writes those files by running each block as a reader would,
from the project root in a shell where the venv is not activated (`run_block`); tests/evidence/test_run_it.py runs
them again and compares, so the page cannot show output its commands no longer print.
"""

from __future__ import annotations

import itertools
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.core.bounded import read_file
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.fences import fence_for, page_text

RUNS_DIR = "runs"
MAX_BYTES = 1 << 20
PROMPT = "$ "
_FENCE = re.compile(r"\s*(`{3,}|~{3,})(.*)")
_NAME = re.compile(r"[\w.-]+", re.ASCII)
_RUN_OUTPUT = re.compile(r"""\{\{\s*run_output\(\s*["']([\w.-]+)["']\s*\)\s*\}\}""")
# A wall-clock figure in a recording ("(467.9 ms wall clock)", "wall clock 0.54"): the one thing a reader's run
# prints differently (tests/evidence/test_run_it.py VARIES), so the page warns of it only where the output has one.
WALL_CLOCK = re.compile(r"\bwall clock\b")


@dataclass(frozen=True)
class RunIt:
    """A Run it block: the template line of its fence, its commands, and the recording shown after it (None
    when the next non-blank line is not `{{ run_output("NAME") }}`)."""

    line: int
    commands: tuple[str, ...]
    recording: str | None


def run_it_blocks(text: str) -> list[RunIt]:
    """Every Run it block of a template, in order."""
    lines, found, number = text.split("\n"), [], 0
    while number < len(lines):
        opening = _FENCE.match(lines[number])
        if not opening:
            number += 1
            continue
        fence, info, end = opening.group(1), opening.group(2), number + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if "run-it" in info:
            after = next((lines[n] for n in range(end + 1, len(lines)) if lines[n].strip()), "")  # no copy
            shown = _RUN_OUTPUT.fullmatch(after.strip())
            commands = tuple(line.strip() for line in lines[number + 1 : end] if line.strip())
            found.append(RunIt(number + 1, commands, shown.group(1) if shown else None))
        number = end + 1
    return found


def recording_path(notes_dir: Path, name: str) -> Path:
    """reading_notes/runs/NAME.txt; NAME as a Run it block may give it (letters, digits, '_', '.', '-'), so
    that a template cannot read a file outside runs/ onto its page."""
    if not _NAME.fullmatch(name) or name.strip(".") == "":
        raise PinAndCiteError(f"recording name {name!r} must be letters, digits, '_', '.' or '-'")
    return notes_dir / RUNS_DIR / f"{name}.txt"


def recording_text(commands: tuple[str, ...], output: str) -> str:
    return "".join(f"{PROMPT}{command}\n" for command in commands) + output


def read_recording(notes_dir: Path, name: str) -> tuple[tuple[str, ...], str]:
    """The commands and the output of reading_notes/runs/NAME.txt; a missing file is a one-line error."""
    data = read_file(recording_path(notes_dir, name), MAX_BYTES, f"{RUNS_DIR}/{name}.txt")
    if data is None:
        raise PinAndCiteError(f"no recorded run {name!r} ({RUNS_DIR}/{name}.txt is missing): run tools/record-runs")
    lines = data.decode("utf-8", errors="replace").split("\n")
    head = itertools.takewhile(lambda line: line.startswith(PROMPT), lines)
    commands = tuple(line.removeprefix(PROMPT) for line in head)
    return commands, "\n".join(lines[len(commands) :])


def run_text(notes_dir: Path, name: str) -> str:
    """The recorded stdout alone, for a page to quote a number from (a bubble, a FLOP count) rather than type it."""
    return page_text(read_recording(notes_dir, name)[1])


def run_output(notes_dir: Path, name: str) -> str:
    """The recorded output, as the page shows it under its Run it block."""
    _, output = read_recording(notes_dir, name)
    fence = fence_for(output)  # longer than any backtick run in it: no line of it can close the block
    shown = f"{fence}{{ .text .run-output }}\n{output.rstrip()}\n{fence}\n"  # wrapped, not cut (notes.css)
    timings = "; timings differ on your machine" if WALL_CLOCK.search(output) else ""
    return f"Expected output (stdout{timings}):\n\n{shown}"


def plain_shell_env() -> dict[str, str]:
    """The environment of a reader's fresh shell: no virtual environment activated, none on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    venv = os.environ.get("VIRTUAL_ENV")
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if p and not (venv and p.startswith(venv))
    )
    return env


def run_block(root: Path, block: RunIt, timeout: float) -> str:
    """Run the block's commands as written, in order, from `root`: their stdout (a failure raises)."""
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", "\n".join(block.commands)],
        cwd=root,
        env=plain_shell_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-1:] or ["(no stderr)"]
        raise PinAndCiteError(f"the Run it block at line {block.line} exited {done.returncode}: {tail[0]}")
    return done.stdout
