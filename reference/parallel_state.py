"""Which ranks talk to which: the world laid out as a PP x DP x TP grid, TP groups of consecutive ranks.

Megatron-core orders its dimensions "tp-cp-ep-dp-pp" by default (megatron/core/parallel_state.py::
initialize_model_parallel, `order`, and RankGenerator): TP varies fastest, so a TP group is a run of
consecutive ranks (on one node, over NVLink), DP next, PP slowest. Here that whole layout is one line,

    grid = torch.arange(world_size).view(pp_size, dp_size, tp_size)

and every group is a slice of the grid: TP groups are grid[p, d, :], DP groups grid[p, :, t], PP groups
grid[:, d, t]. The groups are held by a small object that is passed to the layers explicitly.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


class ParallelConfigError(ValueError):
    """A parallel configuration that cannot work (sizes that do not divide, mismatched tensors)."""


def divide(numerator: int, denominator: int, what: str, by: str = "the tensor-parallel size") -> int:
    """numerator / denominator, or a ParallelConfigError naming both (megatron/core/utils.py::divide)."""
    if denominator <= 0 or numerator % denominator:
        raise ParallelConfigError(f"{what} ({numerator}) is not divisible by {by} ({denominator})")
    return numerator // denominator


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the grid and its process groups (a group of one rank where a size is 1)."""
    grid: torch.Tensor
    rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup

    @property
    def pp_size(self) -> int:
        return self.grid.shape[0]

    @property
    def dp_size(self) -> int:
        return self.grid.shape[1]

    @property
    def tp_size(self) -> int:
        return self.grid.shape[2]

    def coordinates(self, rank: int | None = None) -> tuple[int, int, int]:
        """(pp, dp, tp) index of `rank` (default: this rank)."""
        where = (self.grid == (self.rank if rank is None else rank)).nonzero()[0]
        return tuple(int(i) for i in where)

    @property
    def tp_rank(self) -> int:
        return self.coordinates()[2]

    @property
    def dp_rank(self) -> int:
        return self.coordinates()[1]

    def describe(self) -> str:
        """The layout as text: sizes, every TP and DP group, and where this rank sits."""
        pp, dp, tp = self.grid.shape
        lines = [f"world {self.grid.numel()} = pp {pp} x dp {dp} x tp {tp} (TP groups are consecutive ranks)"]
        lines += [f"  tp group {i}: {g}" for i, g in enumerate(_groups(self.grid, dim=2))]
        lines += [f"  dp group {i}: {g}" for i, g in enumerate(_groups(self.grid, dim=1))]
        if pp > 1:
            lines += [f"  pp group {i}: {g}" for i, g in enumerate(_groups(self.grid, dim=0))]
        p, d, t = self.coordinates()
        lines.append(f"  rank {self.rank}: pp {p}, dp {d}, tp {t}")
        return "\n".join(lines)


def _groups(grid: torch.Tensor, dim: int) -> list[list[int]]:
    """All rank lists along `dim` of the grid, in a fixed order (every rank must create them alike)."""
    return grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist()


def build_layout(tp_size: int, pp_size: int = 1) -> ParallelLayout:
    """Create the TP, DP and PP groups of the initialized world; every rank must call this the same way."""
    if not dist.is_initialized():
        raise ParallelConfigError("torch.distributed is not initialized: call init_process_group first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if tp_size < 1 or pp_size < 1:
        raise ParallelConfigError(f"tp size ({tp_size}) and pp size ({pp_size}) must be positive")
    if world_size % (tp_size * pp_size):
        raise ParallelConfigError(
            f"world size {world_size} is not divisible by tp size {tp_size} x pp size {pp_size}; "
            f"launch a multiple of {tp_size * pp_size} ranks or change --tp-size")
    dp_size = world_size // (tp_size * pp_size)
    grid = torch.arange(world_size).view(pp_size, dp_size, tp_size)
    mine = {}
    for name, dim in (("tp", 2), ("dp", 1), ("pp", 0)):
        for ranks in _groups(grid, dim):
            group = dist.new_group(ranks)  # collective call: every rank creates every group
            if rank in ranks:
                mine[name] = group
    return ParallelLayout(grid=grid, rank=rank, tp_group=mine["tp"], dp_group=mine["dp"], pp_group=mine["pp"])
