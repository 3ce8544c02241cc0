"""Argument checks shared by the reference CLIs, done at parse time so that a bad value is one line and exit 2
before anything is allocated, traced or launched (the bounds say why in the error and in --help)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

DEVICE_CHOICES = ("auto", "cpu", "cuda")
MAX_WORLD = 2**20  # ranks; more than any job run so far, and each command holds a list per rank
MAX_MICROBATCHES = 256  # the scale trace runs every micro-batch through the schedule
MICROBATCHES_WHY = "the trace walks every micro-batch of the schedule, about 0.3 s each per traced rank"


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a refused argument is one line on stderr (`PROG: error: ...`), exit 2."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def size(limit: int, why: str):
    """An argparse type: a whole number from 1 to `limit`, refused with `why` above it."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        if value > limit:
            raise argparse.ArgumentTypeError(f"at most {limit:,} ({why}), got {value:,}")
        return value

    return parse


WORLD_WHY = "more than any job run so far; the groups list every rank"
world_size = size(MAX_WORLD, WORLD_WHY)
microbatches = size(MAX_MICROBATCHES, MICROBATCHES_WHY)


def refuse_large_world(parser: argparse.ArgumentParser, **sizes: int) -> None:
    """Each size may be within bounds while their product is not."""
    world = math.prod(sizes.values())
    if world > MAX_WORLD:
        named = " x ".join(f"{name} {value}" for name, value in sizes.items())
        parser.error(f"{named} = {world:,} ranks; at most {MAX_WORLD:,} ({WORLD_WHY})")


def learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise argparse.ArgumentTypeError(f"expected a positive, finite learning rate, got {text!r}")
    return value


def output_dir(text: str) -> Path:
    """A directory to write into, created now: a path that cannot be made fails here, not after training."""
    path = Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"cannot create directory {text!r}: {exc.strerror}") from None
    return path


def add_flag(parser, spelling: str, *old_spellings: str, **kwargs) -> argparse.Action:
    """`parser.add_argument(spelling, **kwargs)`, still accepting each old spelling but leaving it out of --help,
    so that every CLI of the kit shows one spelling per concept (Megatron-LM's, where it has one)."""
    action = parser.add_argument(spelling, **kwargs)
    hidden = {**kwargs, "dest": action.dest, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
    for old in old_spellings:
        parser.add_argument(old, **hidden)
    return action


def add_device_argument(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--device auto|cpu|cuda`, as every reference command takes it (reference.distributed.pick_device)."""
    parser.add_argument(
        "--device",
        choices=DEVICE_CHOICES,
        default="auto",
        help=help
        or "auto: one GPU per rank when there are enough (NCCL), else CPU (gloo); cuda refuses fewer GPUs than ranks",
    )
