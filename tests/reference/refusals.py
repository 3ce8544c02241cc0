"""Refused command lines run in this process: a CLI's `main(argv)` instead of `python -m ...` in a fresh
interpreter (seconds of importing torch each). Each CLI keeps one end-to-end subprocess test of its own."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch.distributed as dist


def refusal(main: Callable[[list[str]], int | None], argv: list[str], capsys: pytest.CaptureFixture) -> str:
    """The stderr of `main(argv)`, after checking that it refused before doing anything: exit status 2
    (returned or raised as SystemExit), nothing on stdout, and no process group left in this process."""
    try:
        status = main(argv)
    except SystemExit as exit_:
        status = exit_.code
    captured = capsys.readouterr()
    assert status == 2, (status, captured.err)
    assert captured.out == "", captured.out
    assert not dist.is_initialized(), f"{argv} set up a process group before refusing"
    return captured.err
