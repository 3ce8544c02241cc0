"""A second random stream, different on every TP rank, for dropout on activations split across TP ranks.

Dropout on *replicated* activations (the residual stream without sequence parallelism) must draw the same
mask on every TP rank, or the replicas drift apart: it uses the default generator, which every rank seeds
alike and consumes alike. Dropout on *split* activations (attention probabilities of this rank's heads; the
residual stream's sequence slice under SP) must draw independent masks on each rank, or every rank would
drop the same positions of different heads/tokens. Megatron keeps that second stream in its RNG tracker
(megatron/core/tensor_parallel/random.py::CudaRNGStatesTracker, seeded seed + 2718 + tp_rank by
model_parallel_cuda_manual_seed) and swaps it in with `get_cuda_rng_tracker().fork()`; this is the same
idea for the CPU or CUDA default generator.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

_MEGATRON_TP_SEED_OFFSET = 2718


class TensorParallelRNG:
    """Holds the per-TP-rank generator state; `with rng.fork():` runs a block on it, leaving the default
    stream exactly as it was.

    Mirrors `megatron-lm:megatron/core/tensor_parallel/random.py::CudaRNGStatesTracker`.
    """

    def __init__(self, seed: int, tp_group: dist.ProcessGroup, device: torch.device | str | None = None):
        """Mirrors `megatron-lm:megatron/core/tensor_parallel/random.py::model_parallel_cuda_manual_seed`."""
        device = torch.device(device or "cpu")
        # Only CUDA has generators of its own; every other device (CPU, and meta for reference.measure.scale, whose
        # tensors hold no values to drop) draws from the CPU default generator.
        self.device = device if device.type == "cuda" else torch.device("cpu")
        generator = torch.Generator(device=self.device)
        self.state = generator.manual_seed(seed + _MEGATRON_TP_SEED_OFFSET + tp_group.rank()).get_state()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    def _default_stream_preserved(self):
        cuda = self.device.type == "cuda"
        return torch.random.fork_rng(devices=[self.device] if cuda else [], device_type="cuda")

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Mirrors `megatron-lm:megatron/core/tensor_parallel/random.py::CudaRNGStatesTracker.fork`."""
        with self._default_stream_preserved():
            self._set(self.state)
            try:
                yield
            finally:
                self.state = self._get()
