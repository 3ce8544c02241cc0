"""What megatron-core 0.16.1's MoE layer needs to run on CPU/gloo, named once: `megatron_moe_on_cpu()`.

Each stand-in replaces a GPU-only step whose result on a CPU is already there, so it changes no value the
layer computes and nothing a test asserts (routing, shapes, split sizes, collectives and their bytes, outputs,
gradients); it only lets megatron's own code reach the next line. All are undone when the block exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from reference.measure.torch_patches import cuda_calls_on_cpu


class HostStream:
    """Stands in for `torch.cuda.Stream`: the AlltoAll dispatcher copies its split sizes device-to-host on a side
    stream of its own, waiting on the main one (megatron-lm:megatron/core/transformer/moe/token_dispatcher.py,
    `_maybe_dtoh_and_synchronize`). On a CPU every op has finished when it returns: there is nothing to order."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def wait_stream(self, stream: HostStream) -> None:
        pass

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        return event or HostEvent()


class HostEvent:
    """Stands in for `torch.cuda.Event`: the dispatcher synchronizes on one before it reads the copied split
    sizes; on a CPU they were computed synchronously, so there is nothing to wait for."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def record(self, stream: HostStream | None = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


MAIN_STREAM = HostStream()


def host_copy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """Stands in for `moe_utils.maybe_move_tensor_to_cpu`, which copies only CUDA tensors, returning a host copy
    (a numpy array when `as_numpy`, as the dispatcher asks for its split sizes). On a CPU the tensor is left as
    it is, and `all_to_all_single` rejects a tensor of split sizes: here it gets the same values in the type
    the GPU path hands it."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


@contextlib.contextmanager
def megatron_moe_on_cpu() -> Iterator[None]:
    """megatron-core's MoELayer with either dispatcher (allgather, alltoall) runs on CPU/gloo inside the block.

    - `torch.cuda.Stream`, `Event`, `current_stream` and `stream`: HostStream, HostEvent (above).
    - `moe_utils.te_general_gemm = None`: megatron binds the name only when Transformer Engine imports, then
      tests `te_general_gemm is not None` in the router's GEMM (`RouterGatingLinearFunction`), a NameError
      without TE; None is what that test means, and the router takes its plain `torch.mm` branch.
    - `token_dispatcher.maybe_move_tensor_to_cpu`: host_copy (above).
    - `torch.cuda.current_device()` is "cpu" (reference.measure.torch_patches.cuda_calls_on_cpu, for the rest of the
      process): buffers megatron allocates there land on the CPU.
    """
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    cuda_calls_on_cpu()
    cuda = torch.cuda
    saved_cuda = {name: getattr(cuda, name) for name in ("Stream", "Event", "current_stream", "stream")}
    saved_gemm = moe_utils.__dict__.get("te_general_gemm", _ABSENT)
    saved_copy = token_dispatcher.maybe_move_tensor_to_cpu
    saved_side_stream = token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream
    cuda.Stream, cuda.Event = HostStream, HostEvent
    cuda.current_stream = lambda device=None: MAIN_STREAM
    cuda.stream = lambda stream: contextlib.nullcontext()
    moe_utils.te_general_gemm = None
    token_dispatcher.maybe_move_tensor_to_cpu = host_copy
    try:
        yield
    finally:
        for name, value in saved_cuda.items():
            setattr(cuda, name, value)
        if saved_gemm is _ABSENT:
            del moe_utils.te_general_gemm
        else:
            moe_utils.te_general_gemm = saved_gemm
        token_dispatcher.maybe_move_tensor_to_cpu = saved_copy
        token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = saved_side_stream  # not a HostStream


_ABSENT = object()
