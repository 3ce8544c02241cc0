"""Starting and stopping torch.distributed the same way in every demo, benchmark and test worker.

`with distributed("auto") as device:` picks CUDA + NCCL when a GPU is visible (or is asked for), else CPU +
gloo, and tears the process group down on the way out: a barrier, then a garbage collection of the cycles that
still hold the group, then the destroy, since gloo otherwise sometimes aborts a rank whose peer closed first.
A group the caller set up is used and left to the caller. `with one_line_errors(PROG):` ends a refused launch
as every demo does: one line from rank 0, exit 2. docs/reference-guide.md says why each step is there.
While the group lives, reference.heartbeat ends the job when a rank stops answering for the timeout
(REFERENCE_TIMEOUT_S overrides the caller's).
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import sys
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from reference.arguments import DEVICE_CHOICES
from reference.heartbeat import Heartbeat
from reference.parallel_state import ParallelConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The demos' optimizers: SGD keeps no state per parameter; Adam keeps two moments, the state that ZeRO shards.
OPTIMIZERS = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}

# The flat-tensor collectives by their torch 2.13 names; torch 2.13 deprecates the names older torch has,
# all_gather_into_tensor and reduce_scatter_tensor, so each is looked up by feature, not by version.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
TIMEOUT_ENV = "REFERENCE_TIMEOUT_S"
# The timeout is the process group's and the rendezvous store's too: under a few seconds gloo's own
# connection setup fails on a loaded machine; a week is past any demo (and timedelta's range is far beyond)
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 3.0, 7 * 24 * 3600.0
_heartbeat: Heartbeat | None = None  # the one of the group init_distributed made; finish() stops it


class LaunchError(RuntimeError):
    """The process was not started the way torch.distributed needs (no torchrun, no GPU for --device cuda)."""


def pick_device(choice: str = "auto") -> torch.device:
    """cuda:LOCAL_RANK for "cuda", or for "auto" when a GPU per local rank is visible; else cpu. NCCL takes one
    rank per GPU, so more local ranks than GPUs is refused for "cuda" and runs on CPU for "auto"."""
    if choice not in DEVICE_CHOICES:
        raise LaunchError(f"unknown device {choice!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count()
    if choice == "cuda" and not torch.cuda.is_available():
        raise LaunchError("--device cuda but no CUDA device is visible")
    if choice == "cuda" and ranks > gpus:
        raise LaunchError(
            f"--device cuda with {ranks} ranks on this node needs {ranks} GPUs (NCCL takes one rank per GPU), "
            f"found {gpus}; launch at most {gpus} or use --device cpu"
        )
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available() and ranks <= gpus):
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def pick_dtype(choice: str, device: torch.device) -> torch.dtype:
    """The training dtype: "auto" is bf16 on CUDA, as Megatron trains, and fp32 on CPU, where the tests compare
    exactly with the unsharded model."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[choice]


def init_distributed(choice: str = "auto", timeout_s: float = 120) -> torch.device:
    """Initialize the default process group from torchrun's environment and start this rank's heartbeat;
    returns this rank's device. $REFERENCE_TIMEOUT_S, when set, replaces `timeout_s`."""
    global _heartbeat
    if "RANK" not in os.environ:
        raise LaunchError("run under torchrun, e.g. torchrun --nproc-per-node 2 -m reference")
    timeout_s = timeout_from_env(timeout_s)
    device = pick_device(choice)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    if dist.get_world_size() > 1 and Heartbeat.possible():
        _heartbeat = Heartbeat(timeout_s)
        _heartbeat.start()
    return device


def timeout_from_env(default_s: float) -> float:
    """$REFERENCE_TIMEOUT_S as seconds (positive, finite), else `default_s`."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return default_s
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value < math.inf):
        raise LaunchError(f"{TIMEOUT_ENV}={text!r}: expected a positive, finite number of seconds")
    if not MIN_TIMEOUT_S <= value <= MAX_TIMEOUT_S:
        raise LaunchError(
            f"{TIMEOUT_ENV}={text!r}: expected {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:,.0f} seconds (the process "
            "group's and rendezvous' timeout: shorter fails gloo's own connection setup, longer is past any demo)"
        )
    return value


def finish(clean: bool = True) -> None:
    """Destroy the default group; when `clean` (no exception in flight) wait for every peer first."""
    global _heartbeat
    if not dist.is_initialized():
        return
    if clean:
        dist.barrier()
    if _heartbeat is not None:
        _heartbeat.stop()
        _heartbeat = None
    gc.collect()
    dist.destroy_process_group()


@contextlib.contextmanager
def distributed(choice: str = "auto", timeout_s: float = 120) -> Iterator[torch.device]:
    """init_distributed(...) on entry, finish() on exit (without the barrier if the body raised); with a
    default group already set up, only this rank's device (the CPU for "auto" on a gloo group), and the group
    stays."""
    if dist.is_initialized():
        yield torch.device("cpu") if choice == "auto" and dist.get_backend() == "gloo" else pick_device(choice)
        return
    device = init_distributed(choice, timeout_s)
    try:
        yield device
    except BaseException:
        finish(clean=False)
        raise
    finish()


@contextlib.contextmanager
def one_line_errors(prog: str) -> Iterator[None]:
    """A launch or a configuration refused inside (LaunchError, ParallelConfigError) ends the program the way
    every CLI of the kit refuses: `PROG: error: ...` on stderr, from rank 0 only (every rank would say the
    same), exit 2, no traceback."""
    try:
        yield
    except (LaunchError, ParallelConfigError) as error:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"{prog}: error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
