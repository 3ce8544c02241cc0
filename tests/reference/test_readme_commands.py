"""The README's and the reference guide's commands work as written from a fresh clone after `make setup`, in a
shell where the venv is not activated (a newcomer met `torchrun: command not found`): each names a program the
checkout has, a make target the Makefile has, or a module the venv has, with flags its --help shows. The cheap
ones run, as written. Commands quoted inline in prose (`` `torchrun --nproc-per-node 4 -m ...` ``, in these
pages and in the notes' templates) are pasted as well: none may start with a launcher the venv is not on the
PATH for (a newcomer met that too, on the CP walkthrough)."""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", "docs/reference-guide.md"]
VENV = ".venv/bin/"
# The commands also run, not only checked: seconds each (--help, and reference.layout, which starts no process).
RUN = re.compile(r"^\.venv/bin/python -m reference(\.layout .*| --help)$")
# Programs `make setup` puts in .venv/bin/ only; an inline span starting with one and passing a flag is a command.
LAUNCHERS = ("torchrun", "python", "python3")
NOTES = sorted((ROOT / "reading_notes").glob("*.md.j2"))


def commands(markdown: str) -> list[str]:
    """Each command of the page's shell blocks (fenced, with no info string or a shell's or run-it): the lines
    that are neither indented (a comment continued under the one above) nor comments, trailing comment cut."""
    found, fence = [], None
    for line in markdown.splitlines():
        if line.startswith("```"):
            fence = line[3:].strip() if fence is None else None
        elif fence is not None and re.fullmatch(r"(sh|shell|bash|console|.*run-it.*)?", fence):
            if line and not line[0].isspace() and not line.startswith("#"):
                found.append(" ".join(shlex.split(line, comments=True)))
    return found


def inline_commands(markdown: str) -> list[str]:
    """The page's inline code spans, outside fenced blocks and Jinja comments, that are commands: a launcher of
    LAUNCHERS, bare or not, then at least one long flag. A span may wrap onto the next line, as prose is."""
    prose = re.sub(r"^(`{3,}|~{3,}).*?^\1|\{#.*?#\}", "", markdown, flags=re.S | re.M)  # fences, Jinja comments
    spans = (" ".join(s.split()) for s in re.findall(r"(?<!`)`([^`\n]+(?:\n[^`\n]+)?)`(?!`)", prose))
    return [s for s in spans if s and s.split()[0].removeprefix(VENV) in LAUNCHERS and re.search(r"\s--[a-z]", s)]


def problems(command: str) -> list[str]:
    """What would stop `command` from working as written in a fresh clone's un-activated shell."""
    argv = shlex.split(command)
    program = argv[0]
    if program == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M)
        return [f"{command}: no make target {t}" for t in argv[1:] if "=" not in t and t not in targets]
    if program.startswith(VENV):  # made by `make setup`; the running venv has what it holds
        if not (Path(sys.executable).parent / program.removeprefix(VENV)).exists():
            return [f"{command}: the venv has no {program.removeprefix(VENV)}"]
    elif "/" not in program or not os.access(ROOT / program, os.X_OK):
        return [f"{command}: {program} is not a program of the checkout (without an activated venv: {VENV}...)"]
    missing = [f"{command}: no file {arg}" for arg in argv if arg.endswith(".py") and not (ROOT / arg).is_file()]
    if "-m" not in argv:
        return missing
    module, args = argv[argv.index("-m") + 1], argv[argv.index("-m") + 2 :]
    if not module.startswith("reference"):
        return missing + ([] if importlib.util.find_spec(module) else [f"{command}: the venv has no module {module}"])
    cli = importlib.import_module(module)
    if not hasattr(cli, "build_parser"):  # a package: its __main__ is the command
        cli = importlib.import_module(f"{module}.__main__")
    parser = cli.build_parser()
    shown = set(re.findall(r"(?<![\w-])--[a-z][\w-]*", parser.format_help()))
    flags = [arg.split("=")[0] for arg in args if arg.startswith("--")]
    found = missing + [
        f"{command}: {flag} is not a spelling {module} --help shows" for flag in flags if flag not in shown
    ]
    if "--help" not in args:
        try:
            parser.parse_args(args)
        except SystemExit:
            found.append(f"{command}: {module} refuses these arguments")
    return found


@pytest.mark.parametrize("page", PAGES)
def test_every_command_works_without_an_activated_venv(page):
    found = commands((ROOT / page).read_text())
    assert len(found) >= 5, found
    assert not [p for command in found for p in problems(command)]


@pytest.mark.parametrize("page", [*PAGES, *(str(n.relative_to(ROOT)) for n in NOTES)])
def test_no_inline_command_starts_with_a_bare_launcher(page):
    bare = [c for c in inline_commands((ROOT / page).read_text()) if not c.startswith(VENV)]
    assert not bare, f"{page}: write {VENV}{bare[0]}"


def test_a_bare_inline_launcher_is_caught_where_the_prose_wraps_it():
    page = "These come from `torchrun --nproc-per-node {{ cp }} -m\nreference.measure.cp_blocks --json`, and\n"
    page += "`.venv/bin/python -m reference.layout --tp 2`; `torchrun` and `python -m reference` name programs.\n"
    page += "```\ntorchrun -m x --y\n```\n{# `torchrun -m x --y` #}\n"
    assert inline_commands(page) == [
        "torchrun --nproc-per-node {{ cp }} -m reference.measure.cp_blocks --json",
        ".venv/bin/python -m reference.layout --tp 2",
    ]


def test_a_bare_launcher_or_an_old_spelling_is_caught():
    page = "```\ntorchrun --nproc-per-node 2 -m reference --tp 2\n  # a comment\n```\n"
    assert problems(commands(page)[0]) == [
        "torchrun --nproc-per-node 2 -m reference --tp 2: torchrun is not a program of the checkout "
        "(without an activated venv: .venv/bin/...)"
    ]
    assert problems(".venv/bin/python -m reference.measure.scale --microbatches 4 --sp") == [
        f".venv/bin/python -m reference.measure.scale --microbatches 4 --sp: {flag} is not a spelling "
        "reference.measure.scale --help shows"
        for flag in ("--microbatches", "--sp")
    ]
    assert problems("make serve test-all") == ["make serve test-all: no make target test-all"]


def test_the_cheap_commands_run_as_written_in_a_plain_shell():
    """Through bash, from the checkout, with a PATH that has no venv on it. Under `make test` the running venv
    is .venv and each command runs exactly as written; under `make test-torch` its own venv stands in."""
    runnable = [c for c in commands((ROOT / "README.md").read_text()) if RUN.match(c)]
    assert len(runnable) >= 2, runnable
    env = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    venv = os.path.relpath(Path(sys.executable).parent, ROOT) + "/"
    for command in (c.replace(VENV, venv, 1) for c in runnable):
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and done.stdout, (command, done.stderr)
