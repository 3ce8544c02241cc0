"""Which ranks talk to which: the world laid out as a TP x PP x DP grid, TP groups of consecutive ranks.

The grid is built from an `order` string whose first name varies fastest over the ranks; the default here,
"tp-pp-dp", makes TP groups runs of consecutive ranks (one node), then stages, then replicas ("tp-dp-pp" is
Megatron's default). The grid is kept indexed [pp, dp, tp] (`rank_grid`), every group is a slice of it, and
the groups are held by a small object passed to the layers explicitly. Expert parallelism, carved out of DP,
has a second grid (`expert_grid`).

Mirrors `megatron-lm:megatron/core/parallel_state.py::initialize_model_parallel` and
`megatron-lm:megatron/core/parallel_state.py::RankGenerator` (notes/reference/parallel_state.md has an
8-rank example; `python -m reference.layout` prints any).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

ORDERS = ("tp-pp-dp", "tp-dp-pp")


class ParallelConfigError(ValueError):
    """A parallel configuration that cannot work (sizes that do not divide, mismatched tensors)."""


def divide(numerator: int, denominator: int, what: str, by: str = "the tensor-parallel size") -> int:
    """numerator / denominator, or a ParallelConfigError naming both (megatron/core/utils.py::divide).

    Mirrors `megatron-lm:megatron/core/utils.py::divide`.
    """
    if denominator <= 0 or numerator % denominator:
        raise ParallelConfigError(f"{what} ({numerator}) is not divisible by {by} ({denominator})")
    return numerator // denominator


def parallel_sizes(
    world_size: int, tp_size: int = 1, pp_size: int = 1, dp_size: int | None = None
) -> tuple[int, int, int]:
    """(tp, pp, dp) for `world_size` ranks; dp defaults to what is left. Refuses sizes whose product is not
    the world size."""
    if min(tp_size, pp_size, dp_size or 1) < 1:
        raise ParallelConfigError(f"parallel sizes must be >= 1 (tp {tp_size}, pp {pp_size}, dp {dp_size})")
    if dp_size is None:
        dp_size = divide(world_size, tp_size * pp_size, "the world size", by=f"tp {tp_size} x pp {pp_size}")
    if tp_size * pp_size * dp_size != world_size:
        raise ParallelConfigError(
            f"tp {tp_size} x pp {pp_size} x dp {dp_size} = {tp_size * pp_size * dp_size} "
            f"ranks, but the world has {world_size}"
        )
    return tp_size, pp_size, dp_size


def rank_grid(tp_size: int, pp_size: int, dp_size: int, order: str = "tp-pp-dp") -> torch.Tensor:
    """The ranks as a [pp, dp, tp] tensor; `order` lists the dimensions from fastest- to slowest-varying.

    Mirrors `megatron-lm:megatron/core/parallel_state.py::RankGenerator`.
    """
    if order not in ORDERS:
        raise ParallelConfigError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    world = tp_size * pp_size * dp_size
    if order == "tp-dp-pp":
        return torch.arange(world).view(pp_size, dp_size, tp_size)
    return torch.arange(world).view(dp_size, pp_size, tp_size).transpose(0, 1)


def groups(grid: torch.Tensor, kind: str) -> list[list[int]]:
    """Every rank list of one kind ("tp", "pp" or "dp"), sorted by first rank (every rank creates them alike)."""
    dim = {"pp": 0, "dp": 1, "tp": 2}[kind]
    return sorted(grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist())


def grid_coordinates(grid: torch.Tensor, rank: int) -> tuple[int, int, int]:
    """(pp, dp, tp) index of `rank` in a [pp, dp, tp] grid."""
    return tuple((grid == rank).nonzero()[0].tolist())


def expert_grid(tp_size: int, pp_size: int, dp_size: int, ep_size: int, order: str = "tp-pp-dp") -> torch.Tensor:
    """The ranks of the MoE layers as a [pp, edp, ep, tp] tensor: expert parallelism (EP) carved out of data
    parallelism (dp = ep x edp), varying right after TP, as megatron-core lays out its expert groups (with its
    default expert-TP size, the TP size). With pipeline stages, megatron needs the order "tp-dp-pp" for that.

    Mirrors `megatron-lm:megatron/core/parallel_state.py::initialize_model_parallel` (its expert RankGenerator).
    """
    if order not in ORDERS:
        raise ParallelConfigError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    edp = divide(dp_size, ep_size, "the data-parallel size", by="the expert-parallel size")
    if order == "tp-pp-dp" and pp_size > 1 and ep_size > 1:
        raise ParallelConfigError(
            "expert parallelism with pipeline stages needs order tp-dp-pp: megatron-core requires the expert "
            "layers' data-parallel size to equal the others' unless pp varies slowest"
        )
    world = tp_size * pp_size * dp_size
    if order == "tp-dp-pp":
        return torch.arange(world).view(pp_size, edp, ep_size, tp_size)
    return torch.arange(world).view(edp, pp_size, ep_size, tp_size).transpose(0, 1)


def expert_groups(grid: torch.Tensor, kind: str) -> list[list[int]]:
    """Every rank list of one kind ("ep" or "edp", the experts' data-parallel groups) of an expert grid."""
    dim = {"edp": 1, "ep": 2}[kind]
    return sorted(grid.movedim(dim, -1).reshape(-1, grid.shape[dim]).tolist())


def describe_grid(grid: torch.Tensor, order: str, rank: int | None = None, experts: torch.Tensor | None = None) -> str:
    """The layout as text: sizes, every TP, PP and DP group (and, given an expert grid with EP > 1, every EP and
    expert-DP group), and (optionally) where `rank` sits."""
    pp, dp, tp = grid.shape
    lines = [f"world {grid.numel()} = tp {tp} x pp {pp} x dp {dp}, order {order} (first varies fastest)"]
    for kind in ("tp", "pp", "dp"):
        lines.append(f"  {kind} groups: " + " ".join(str(g).replace(" ", "") for g in groups(grid, kind)))
    if experts is not None and experts.shape[2] > 1:
        lines.append(f"  experts: ep {experts.shape[2]} x expert dp {experts.shape[1]} (dp = ep x expert dp)")
        for kind in ("ep", "edp"):
            listed = " ".join(str(g).replace(" ", "") for g in expert_groups(experts, kind))
            lines.append(f"  {'expert dp' if kind == 'edp' else kind} groups: {listed}")
    if rank is not None:
        p, d, t = grid_coordinates(grid, rank)
        where = f"  rank {rank}: tp {t}, pp {p}, dp {d}"
        if experts is not None and experts.shape[2] > 1:
            where += f", ep {(experts == rank).nonzero()[0][2].item()}"
        lines.append(where)
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class ParallelLayout:
    """This rank's place in the grid and its process groups (a group of one rank where a size is 1)."""

    grid: torch.Tensor
    order: str
    rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    experts: torch.Tensor | None = None  # the expert grid [pp, edp, ep, tp] when ep > 1 (expert_grid)
    ep_group: dist.ProcessGroup | None = None  # None: ep 1, no MoE communication
    expert_dp_group: dist.ProcessGroup | None = None

    @property
    def ep_size(self) -> int:
        return 1 if self.experts is None else self.experts.shape[2]

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
        return grid_coordinates(self.grid, self.rank if rank is None else rank)

    @property
    def tp_rank(self) -> int:
        return self.coordinates()[2]

    @property
    def dp_rank(self) -> int:
        return self.coordinates()[1]

    @property
    def pp_rank(self) -> int:
        return self.coordinates()[0]

    def describe(self) -> str:
        return describe_grid(self.grid, self.order, self.rank, self.experts)

    @functools.cached_property
    def _kinds(self) -> dict[tuple[int, ...], str]:
        p, d, t = self.coordinates()
        own = {"dp": self.grid[p, :, t], "pp": self.grid[:, d, t], "tp": self.grid[p, d, :]}
        return {tuple(own[kind].tolist()): kind for kind in ("dp", "pp", "tp")}  # TP wins where groups coincide

    def group_kind(self, ranks: tuple[int, ...]) -> str:
        """ "tp", "pp" or "dp": which of this rank's groups holds exactly `ranks` (a recorded collective's
        group); "other" for any other group."""
        return self._kinds.get(tuple(ranks), "other")


def build_layout(
    tp_size: int, pp_size: int = 1, dp_size: int | None = None, order: str = "tp-pp-dp", ep_size: int = 1
) -> ParallelLayout:
    """Create the TP, PP and DP groups of the initialized world (and with `ep_size` > 1 the expert-parallel and
    expert data-parallel groups, expert_grid's); every rank must call this the same way.

    Mirrors `megatron-lm:megatron/core/parallel_state.py::initialize_model_parallel`.
    """
    if not dist.is_initialized():
        raise ParallelConfigError("torch.distributed is not initialized: call init_process_group first")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    tp, pp, dp = parallel_sizes(world_size, tp_size, pp_size, dp_size)
    grid = rank_grid(tp, pp, dp, order=order)
    experts = expert_grid(tp, pp, dp, ep_size, order) if ep_size > 1 else None
    listed = [(kind, ranks) for kind in ("tp", "pp", "dp") for ranks in groups(grid, kind)]
    if experts is not None:
        listed += [(kind, ranks) for kind in ("ep", "edp") for ranks in expert_groups(experts, kind)]
    mine = {}
    for kind, ranks in listed:
        group = dist.new_group(ranks)  # collective call: every rank creates every group
        if rank in ranks:
            mine[kind] = group
    return ParallelLayout(
        grid=grid,
        order=order,
        rank=rank,
        tp_group=mine["tp"],
        dp_group=mine["dp"],
        pp_group=mine["pp"],
        experts=experts,
        ep_group=mine.get("ep"),
        expert_dp_group=mine.get("edp"),
    )
