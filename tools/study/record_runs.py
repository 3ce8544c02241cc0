"""`tools/record-runs [NAME ...]`: run the walkthroughs' Run it blocks and record what they print.

Each block runs as a reader runs it (study.run_it.run_block: from the project root, the venv not
activated) and its commands and stdout are written to reading_notes/runs/NAME.txt, the file the page shows
with run_output("NAME") and tests/evidence/test_run_it.py compares with a fresh run. Re-record after changing a
block or the demo it runs, and commit the result. Exit status: 0 recorded, 1 a run failed, 2 a usage error
(a name no Run it block records).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.errors import PinAndCiteError
from study.note_rules import walkthrough_runs
from study.run_it import recording_path, recording_text, run_block

ROOT = Path(__file__).resolve().parents[2]
NOTES = ROOT / "reading_notes"
TIMEOUT_S = 300


def main(argv: list[str] | None = None) -> int:
    blocks = {block.recording: block for _, block in walkthrough_runs(NOTES) if block.recording}
    parser = argparse.ArgumentParser(prog="record-runs", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"default: all of {', '.join(sorted(blocks))}")
    args = parser.parse_args(argv)
    if unknown := sorted(set(args.names) - set(blocks)):
        parser.error(f"no Run it block records {', '.join(unknown)} (recorded: {', '.join(sorted(blocks))})")
    try:
        outputs = {name: run_block(ROOT, blocks[name], TIMEOUT_S) for name in args.names or sorted(blocks)}
    except (PinAndCiteError, subprocess.TimeoutExpired) as exc:
        print(f"record-runs: error: {exc}", file=sys.stderr)
        return 1
    for name, output in outputs.items():  # written only once every run succeeded: nothing half-recorded
        path = recording_path(NOTES, name)
        atomic_write(path, recording_text(blocks[name].commands, output).encode())
        print(path.relative_to(ROOT))
    return 0


if __name__ == "__main__":
    sys.exit(main())
