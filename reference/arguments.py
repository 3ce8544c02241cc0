"""Argument checks shared by the reference CLIs, done at parse time so that a bad value is one line and exit 2
before anything is allocated, traced or launched (the bounds say why in the error and in --help)."""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

DEVICE_CHOICES = ("auto", "cpu", "cuda")
MAX_WORLD = 2**20  # ranks; more than any job run so far, and each command holds a list per rank
MAX_MICROBATCHES = 256  # the scale trace runs every micro-batch through the schedule
MICROBATCHES_WHY = "the trace walks every micro-batch of the schedule, about 0.3 s each per traced rank"
MAX_STEPS = 100_000  # the demos run a few steps, each a line of output
MAX_EXPERTS = 4096  # the MoE layer holds a module per expert; DeepSeek-V3 has 256
MAX_WIDTH = 1 << 20  # hidden and FFN sizes, sequence lengths: the memory estimate bounds their products
MAX_ROUTING_SKEW = 64.0  # past it the coldest expert's Zipf share (i + 1)^-S underflows to zero
MAX_BYTES_PER_RANK = 64 << 30  # the demos are small models; more is a typo, and the allocator would be the one to say


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


steps = size(MAX_STEPS, "a few steps show the collectives; each prints a line")
width = size(MAX_WIDTH, "the estimate of each rank's memory bounds the products")
experts = size(MAX_EXPERTS, "the layer holds a module per expert; DeepSeek-V3 has 256")


def positive_finite(what: str, upper: float = math.inf, why: str = ""):
    """An argparse type: a number above 0, below `upper` (refused with `why` at or above it) and finite."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (0 < value < math.inf):
            raise argparse.ArgumentTypeError(f"expected a positive, finite {what}, got {text!r}")
        if value >= upper:
            raise argparse.ArgumentTypeError(f"below {upper:g} ({why}), got {text!r}")
        return value

    return parse


def routing_skew(text: str) -> float:
    """A Zipf exponent: 0 (uniform) up to MAX_ROUTING_SKEW."""
    if text.strip() in ("0", "0.0"):
        return 0.0
    why = "the coldest expert's share would underflow to 0"
    return positive_finite("routing skew (a Zipf exponent, or 0)", MAX_ROUTING_SKEW, why)(text)


def memory_bound() -> int:
    """Bytes one rank may be estimated to need: MAX_BYTES_PER_RANK, or this machine's memory shared by its
    local ranks when that is less."""
    try:
        machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        machine = MAX_BYTES_PER_RANK
    return min(MAX_BYTES_PER_RANK, machine // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)))


def refuse_large_memory(what: str, parts: dict[str, float]) -> str | None:
    """Why a run whose rank needs about sum(`parts`) bytes (each named by the flags that size it) cannot start,
    or None when it fits memory_bound()."""
    total, bound = sum(parts.values()), memory_bound()
    if total <= bound:
        return None
    largest = max(parts, key=parts.get)
    return (
        f"{what} needs about {_gib(total)} per rank, most of it {largest}; at most {_gib(bound)} per rank "
        f"(this machine's memory over its local ranks, and {_gib(MAX_BYTES_PER_RANK)} at most: the demos are small)"
    )


def _gib(value: float) -> str:
    return f"{value / (1 << 30):,.1f} GiB"


def refuse_large_world(parser: argparse.ArgumentParser, **sizes: int) -> None:
    """Each size may be within bounds while their product is not."""
    world = math.prod(sizes.values())
    if world > MAX_WORLD:
        named = " x ".join(f"{name} {value}" for name, value in sizes.items())
        parser.error(f"{named} = {world:,} ranks; at most {MAX_WORLD:,} ({WORLD_WHY})")


learning_rate = positive_finite("learning rate")


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
