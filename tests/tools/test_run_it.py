"""Run it blocks: found in a template as written, run as a reader runs them, recorded all or nothing."""

from __future__ import annotations

import pytest

from pin_and_cite.core.errors import PinAndCiteError
from study import record_runs
from study.run_it import RunIt, read_recording, run_block, run_it_blocks, run_output, run_text

TEMPLATE = """---
rules: walkthrough
---
```shell
echo not a run-it block
```

~~~{ .shell .run-it }
echo "first ```"
printf 'two\\n'
~~~

{{ run_output("first") }}

````{ .shell .run-it }
false
````
Some prose, not the output.
"""


def test_blocks_are_found_with_their_commands_and_the_recording_shown_after_them():
    assert run_it_blocks(TEMPLATE) == [
        RunIt(8, ('echo "first ```"', "printf 'two\\n'"), "first"),
        RunIt(15, ("false",), None),
    ]


def test_a_block_runs_from_the_root_as_written_without_the_venv(tmp_path, monkeypatch):
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path / ".venv"))
    monkeypatch.setenv("PATH", f"{tmp_path / '.venv' / 'bin'}:/usr/bin:/bin")
    block = RunIt(3, ("pwd", 'echo "venv=${VIRTUAL_ENV:-none}"', 'echo "$PATH"'), "x")
    assert run_block(tmp_path, block, 10) == f"{tmp_path}\nvenv=none\n/usr/bin:/bin\n"


def test_a_failing_command_stops_the_block_with_one_line(tmp_path):
    block = RunIt(7, ("echo before", "ls /no/such/path", "echo after"), "x")
    with pytest.raises(PinAndCiteError) as failed:
        run_block(tmp_path, block, 10)
    message = str(failed.value)
    assert message.startswith("the Run it block at line 7 exited 2: ls: ") and "\n" not in message


def test_the_page_shows_the_output_without_the_commands_in_a_fence_it_cannot_close(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "first.txt").write_text("$ echo \"first ```\"\n$ printf 'two\\n'\nfirst ```\ntwo\n")
    assert read_recording(tmp_path, "first") == (('echo "first ```"', "printf 'two\\n'"), "first ```\ntwo\n")
    shown = run_output(tmp_path, "first")
    assert shown.endswith("````{ .text .run-output }\nfirst ```\ntwo\n````\n") and "$ " not in shown


def test_the_page_warns_of_timings_only_where_the_output_has_a_wall_clock_figure(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "moe.txt").write_text("$ echo loss\nstep 1: loss 0.396059\n")
    (tmp_path / "runs" / "tp.txt").write_text("$ echo loss\nstep 0: loss 4.865125 (467.9 ms wall clock)\n")
    assert run_output(tmp_path, "moe").startswith("Expected output (stdout):\n")
    assert run_output(tmp_path, "tp").startswith("Expected output (stdout; timings differ on your machine):\n")


def test_a_page_quotes_the_recorded_output_and_names_no_file_outside_runs(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "pp-4.txt").write_text("$ echo bubble\nbubble 0.27\n")
    (tmp_path / "secret.txt").write_text("$ cat\nnot for the page\n")
    assert run_text(tmp_path, "pp-4") == "bubble 0.27\n"
    for name in ("../secret", "runs/../../secret", "/etc/hostname", "..", ""):
        with pytest.raises(PinAndCiteError, match="must be letters, digits"):
            run_text(tmp_path, name)
        with pytest.raises(PinAndCiteError, match="must be letters, digits"):
            run_output(tmp_path, name)


def walkthrough_project(tmp_path, monkeypatch, second: str):
    notes = tmp_path / "reading_notes"
    notes.mkdir(exist_ok=True)
    block = '```{ .shell .run-it }\n%s\n```\n\n{{ run_output("%s") }}\n'
    (notes / "w.md.j2").write_text(
        "---\nrules: walkthrough\n---\n" + block % ("echo one", "one") + block % (second, "two")
    )
    monkeypatch.setattr(record_runs, "ROOT", tmp_path)
    monkeypatch.setattr(record_runs, "NOTES", notes)
    return notes / "runs"


def test_record_runs_writes_every_recording_or_none(tmp_path, monkeypatch, capsys):
    runs = walkthrough_project(tmp_path, monkeypatch, second="echo two; exit 3")
    assert record_runs.main([]) == 1
    assert not runs.exists()  # the first block ran fine, but nothing is half-recorded
    assert capsys.readouterr().err == "record-runs: error: the Run it block at line 9 exited 3: (no stderr)\n"
    runs = walkthrough_project(tmp_path, monkeypatch, second="echo two")
    assert record_runs.main(["two"]) == 0 and sorted(p.name for p in runs.iterdir()) == ["two.txt"]
    assert (runs / "two.txt").read_text() == "$ echo two\ntwo\n"
    with pytest.raises(SystemExit) as usage:
        record_runs.main(["three"])
    assert usage.value.code == 2 and "no Run it block records three" in capsys.readouterr().err


def test_a_recorded_line_starting_with_a_prompt_is_output_not_a_command(tmp_path):
    """The commands are the recording's first `$ ` lines only: a block printing `$ ls` once read back as
    running `ls` (N43), so check said the recording was of other commands and the page lost that line."""
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "x.txt").write_text("$ echo 'prompt:'; echo '$ ls'\nprompt:\n$ ls\n")
    assert read_recording(tmp_path, "x") == (("echo 'prompt:'; echo '$ ls'",), "prompt:\n$ ls\n")
