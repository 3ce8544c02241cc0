"""Which ranks talk to which: one mesh of named dimensions, and every process group a slice of it.

The world is one tensor of ranks (picotron's `torch.arange(world).view(...)`) with axes named as torchtitan's
ParallelDims names them: pp, dp (dp_replicate x dp_shard; HSDP splits it), cp and tp. Which axis varies fastest
follows megatron-core's `order`: TP, then CP, then "pp-dp" (the default here, "tp-pp-dp": TP groups are
consecutive ranks, then stages, then replicas) or "dp-pp" ("tp-dp-pp", megatron's default). The MoE layers read a
second view of the same ranks, [pp, edp, ep, tp]: EP carved out of dp x cp, right after TP (megatron's expert
rank generator, expert TP = TP). The embedding group pairs each pipeline's first and last stage.

Creating a group is a collective of the whole world, so every group, and every torch device mesh on them, is made
here, by every rank, in one order. A new dimension is a size of Mesh, a place in DIMS and the order, and an entry
of GROUPS: this file alone.

Mirrors `megatron-lm:megatron/core/parallel_state.py::initialize_model_parallel` and
`megatron-lm:megatron/core/parallel_state.py::RankGenerator` (notes/reference/parallel_state.md;
`python -m reference.layout` prints any layout).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import torch.distributed as dist

ORDERS = ("tp-pp-dp", "tp-dp-pp")
DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # the dense view's axes
EXPERT_DIMS = ("pp", "edp", "ep", "tp")  # the MoE layers' view of the same ranks
GROUPS = {  # name: the axes its groups span (ep, edp: of the expert view), created in this order
    "tp": ("tp",),
    "cp": ("cp",),
    "pp": ("pp",),
    "dp": ("dp_replicate", "dp_shard"),
    "dp_replicate": ("dp_replicate",),
    "dp_shard": ("dp_shard",),
    "dp_cp": ("dp_replicate", "dp_shard", "cp"),  # gradients and loss (megatron: dp with context parallel)
    "ep": ("ep",),
    "edp": ("edp",),
}


class ParallelConfigError(ValueError):
    """A parallel configuration that cannot work (sizes that do not divide, mismatched tensors)."""


def divide(numerator: int, denominator: int, what: str, by: str = "the tensor-parallel size") -> int:
    """numerator / denominator, or a ParallelConfigError naming both.

    Mirrors `megatron-lm:megatron/core/utils.py::divide`.
    """
    if denominator <= 0 or numerator % denominator:
        raise ParallelConfigError(f"{what} ({numerator}) is not divisible by {by} ({denominator})")
    return numerator // denominator


def parallel_sizes(
    world_size: int, tp_size: int = 1, pp_size: int = 1, dp_size: int | None = None, cp_size: int = 1
) -> tuple[int, int, int]:
    """(tp, pp, dp) for `world_size` ranks; dp defaults to what is left. Refuses sizes whose product is not
    the world size."""
    if min(tp_size, pp_size, dp_size or 1, cp_size) < 1:
        raise ParallelConfigError(f"parallel sizes must be >= 1 (tp {tp_size}, pp {pp_size}, dp {dp_size})")
    cp, rest = (f" x cp {cp_size}" if cp_size > 1 else ""), tp_size * cp_size * pp_size
    if dp_size is None:
        dp_size = divide(world_size, rest, "the world size", by=f"tp {tp_size}{cp} x pp {pp_size}")
    if rest * dp_size != world_size:
        raise ParallelConfigError(
            f"tp {tp_size}{cp} x pp {pp_size} x dp {dp_size} = {rest * dp_size} ranks, but the world has {world_size}"
        )
    return tp_size, pp_size, dp_size


def ordered(sizes: dict[str, int], order: list[str], dims: tuple[str, ...]) -> torch.Tensor:
    """The ranks as a tensor indexed by `dims`, where `order` names them from fastest- to slowest-varying.

    Mirrors `megatron-lm:megatron/core/parallel_state.py::RankGenerator`.
    """
    slowest_first = order[::-1]
    ranks = torch.arange(math.prod(sizes.values())).view([sizes[name] for name in slowest_first])
    return ranks.permute([slowest_first.index(name) for name in dims])


def rank_lists(view: torch.Tensor, dims: tuple[str, ...], axes: tuple[str, ...]) -> list[list[int]]:
    """Every group spanning `axes` of `view`, sorted by first rank: one row per group once those axes go last."""
    moved = view.movedim([dims.index(a) for a in axes], list(range(-len(axes), 0)))
    return sorted(moved.reshape(-1, math.prod(moved.shape[-len(axes) :])).tolist())


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The world's ranks under named dimensions, with no process groups: `reference.layout` prints it, the
    scale simulation reads it, `build_layout` creates its groups."""

    tp: int
    pp: int
    dp: int
    cp: int = 1
    ep: int = 1
    dp_replicate: int = 1
    order: str = "tp-pp-dp"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ParallelConfigError(f"unknown order {self.order!r}; choose one of {', '.join(ORDERS)}")
        divide(self.dp, self.dp_replicate, "the data-parallel size", by="the HSDP replica count")
        span = "the data-parallel size" if self.cp == 1 else "dp x cp"
        divide(self.dp * self.cp, self.ep, span, by="the expert-parallel size")
        if self.order == "tp-pp-dp" and self.pp > 1 and self.ep > 1:
            raise ParallelConfigError(
                "expert parallelism with pipeline stages needs order tp-dp-pp: megatron-core requires the expert "
                "layers' data-parallel size to equal the others' unless pp varies slowest"
            )

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def sizes(self) -> dict[str, int]:
        """Every dimension's size, both views' (edp: the experts' data-parallel size, dp x cp / ep)."""
        shard, edp = self.dp // self.dp_replicate, self.dp * self.cp // self.ep
        dense = dict(tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp, dp_replicate=self.dp_replicate, dp_shard=shard)
        return {**dense, "ep": self.ep, "edp": edp}

    @functools.cached_property
    def dense(self) -> torch.Tensor:
        """The ranks indexed [pp, dp_replicate, dp_shard, cp, tp] (DIMS)."""
        order = self.order.replace("tp-", "tp-cp-").replace("dp", "dp_shard-dp_replicate").split("-")
        return ordered({n: self.sizes()[n] for n in DIMS}, order, DIMS)

    @functools.cached_property
    def expert(self) -> torch.Tensor:
        """The ranks indexed [pp, edp, ep, tp] (EXPERT_DIMS), with expert TP = TP.

        Mirrors `megatron-lm:megatron/core/parallel_state.py::initialize_model_parallel` (its expert RankGenerator).
        """
        order = self.order.replace("tp-", "tp-ep-").replace("dp", "edp").split("-")
        return ordered({n: self.sizes()[n] for n in EXPERT_DIMS}, order, EXPERT_DIMS)

    def ranks(self, name: str) -> list[list[int]]:
        """Every group of `name` (a key of GROUPS, or "embedding"), sorted by first rank."""
        if name == "embedding":  # the first and last stage of each pipeline
            return [[g[0], g[-1]] for g in self.ranks("pp")] if self.pp > 1 else []
        axes = GROUPS[name]
        return rank_lists(*((self.expert, EXPERT_DIMS) if name in ("ep", "edp") else (self.dense, DIMS)), axes)

    @property
    def grid(self) -> torch.Tensor:
        """The ranks indexed [pp, dp, cp, tp]; at cp 1 (all of this issue) a [pp, dp, tp] tensor."""
        grid = self.dense.reshape(self.pp, self.dp, self.cp, self.tp)
        return grid[:, :, 0] if self.cp == 1 else grid

    def where(self, rank: int, view: str = "dense") -> dict[str, int]:
        """`rank`'s index along every dimension of a view ("dense" or "expert"), dp among them."""
        tensor, dims = (self.expert, EXPERT_DIMS) if view == "expert" else (self.dense, DIMS)
        at = dict(zip(dims, (tensor == rank).nonzero()[0].tolist()))
        if view == "dense":
            at["dp"] = at["dp_replicate"] * (self.dp // self.dp_replicate) + at["dp_shard"]
        return at

    def describe(self, rank: int | None = None) -> str:
        """The layout as text: sizes, every TP, (CP,) PP and DP group, with EP > 1 every EP and expert-DP group,
        and (optionally) where `rank` sits. CP appears only where its size is above 1."""
        cp = self.cp > 1
        order = self.order.replace("tp-", "tp-cp-") if cp else self.order
        sizes = f"tp {self.tp} x cp {self.cp}" if cp else f"tp {self.tp}"
        lines = [f"world {self.world} = {sizes} x pp {self.pp} x dp {self.dp}, order {order} (first varies fastest)"]
        for kind in ("tp", "cp", "pp", "dp") if cp else ("tp", "pp", "dp"):
            lines.append(f"  {kind} groups: " + " ".join(str(g).replace(" ", "") for g in self.ranks(kind)))
        if self.ep > 1:
            span = "dp x cp" if cp else "dp"
            lines.append(f"  experts: ep {self.ep} x expert dp {self.sizes()['edp']} ({span} = ep x expert dp)")
            for kind in ("ep", "edp"):
                listed = " ".join(str(g).replace(" ", "") for g in self.ranks(kind))
                lines.append(f"  {'expert dp' if kind == 'edp' else kind} groups: {listed}")
        if rank is not None:
            at = {**self.where(rank, "expert"), **self.where(rank)}
            shown = [n for n in ("tp", "cp", "pp", "dp", "ep") if n not in ("cp", "ep") or self.sizes()[n] > 1]
            lines.append(f"  rank {rank}: " + ", ".join(f"{name} {at[name]}" for name in shown))
        return "\n".join(lines)


def create_groups(rank_lists: list[list[int]], what: str | None = None) -> dist.ProcessGroup | None:
    """One process group per rank list, created in that order; returns this rank's (None if in none).

    Creating a group is a collective of the whole world: every rank must pass the same lists, or ranks create
    groups in different orders (a hang). Given `what`, the lists must partition the world (refused otherwise)."""
    listed = sorted(rank for ranks in rank_lists for rank in ranks)
    if what is not None and listed != list(range(dist.get_world_size())):
        raise ValueError(f"{what} over {len(listed)} of {dist.get_world_size()} ranks: cut it from the whole mesh")
    mine = None
    for ranks in rank_lists:
        group = dist.new_group(ranks)  # a collective: every rank creates every group
        if dist.get_rank() in ranks:
            mine = group
    return mine


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelLayout:
    """This rank's place in the mesh and its process groups: `group("tp")`, `size("cp")`, `rank_in("dp")`,
    `ranks("ep")` (every group of a kind), and the attributes the layers read (tp_group, tp_size, tp_rank, ...)."""

    mesh: Mesh
    rank: int
    groups: dict[str, dist.ProcessGroup | None]

    def group(self, name: str) -> dist.ProcessGroup | None:
        """This rank's group of `name` (a group of one rank where the size is 1; "embedding": None on a middle
        stage or without pipelining)."""
        return self.groups[name]

    def size(self, name: str) -> int:
        return self.mesh.sizes()[name]

    def rank_in(self, name: str) -> int:
        """This rank's index along dimension `name`."""
        return self._at["expert" if name in ("ep", "edp") else "dense"][name]

    def ranks(self, name: str) -> list[list[int]]:
        """Every group of `name` in the world, sorted by first rank (megatron's `RankGenerator.get_ranks`)."""
        return self.mesh.ranks(name)

    def members(self, name: str) -> tuple[int, ...]:
        """The ranks of this rank's group of `name` (empty where it is in none)."""
        return next((tuple(g) for g in self.ranks(name) if self.rank in g), ())

    @functools.cached_property
    def _at(self) -> dict[str, dict[str, int]]:
        return {view: self.mesh.where(self.rank, view) for view in ("dense", "expert")}

    def local(self, names: tuple[str, ...]) -> torch.Tensor:
        """The ranks that share this rank's other coordinates, indexed by `names` (dense dimensions, in order)."""
        at = self._at["dense"]
        index = tuple(slice(None) if dim in names else at[dim] for dim in DIMS)
        return self.mesh.dense[index].permute([[d for d in DIMS if d in names].index(n) for n in names])

    def device_mesh(self, names: tuple[str, ...], device_type: str):
        """A torch DeviceMesh over dense dimensions `names` on this layout's groups (no group of its own)."""
        from torch.distributed.device_mesh import DeviceMesh

        groups = [self.group(name) for name in names]
        mesh = self.local(names)
        return DeviceMesh.from_group(groups if len(names) > 1 else groups[0], device_type, mesh, mesh_dim_names=names)

    grid = property(lambda self: self.mesh.grid)
    order = property(lambda self: self.mesh.order)
    experts = property(lambda self: self.mesh.expert if self.mesh.ep > 1 else None)  # [pp, edp, ep, tp]
    tp_group = property(lambda self: self.groups["tp"])
    dp_group = property(lambda self: self.groups["dp"])
    pp_group = property(lambda self: self.groups["pp"])
    ep_group = property(lambda self: self.groups["ep"] if self.mesh.ep > 1 else None)  # None: no MoE traffic
    expert_dp_group = property(lambda self: self.groups["edp"] if self.mesh.ep > 1 else None)
    tp_size = property(lambda self: self.mesh.tp)
    pp_size = property(lambda self: self.mesh.pp)
    dp_size = property(lambda self: self.mesh.dp)
    ep_size = property(lambda self: self.mesh.ep)
    tp_rank = property(lambda self: self.rank_in("tp"))
    pp_rank = property(lambda self: self.rank_in("pp"))
    dp_rank = property(lambda self: self.rank_in("dp"))

    def coordinates(self, rank: int | None = None) -> tuple[int, int, int]:
        """(pp, dp, tp) index of `rank` (default: this rank)."""
        at = self._at["dense"] if rank is None else self.mesh.where(rank)
        return at["pp"], at["dp"], at["tp"]

    def describe(self) -> str:
        return self.mesh.describe(self.rank)

    @functools.cached_property
    def _kinds(self) -> dict[tuple[int, ...], str]:
        return {self.members(kind): kind for kind in ("dp_cp", "cp", "dp", "pp", "tp")}  # the last wins: cp 1 as before

    def group_kind(self, ranks: tuple[int, ...]) -> str:
        """ "tp", "pp" or "dp" (with cp > 1 also "cp", "dp_cp"): which of this rank's groups holds exactly
        `ranks` (a recorded collective's group); "other" for any other group."""
        return self._kinds.get(tuple(ranks), "other")


def build_layout(
    tp_size: int,
    pp_size: int = 1,
    dp_size: int | None = None,
    order: str = "tp-pp-dp",
    ep_size: int = 1,
    cp_size: int = 1,
    dp_replicate: int = 1,
) -> ParallelLayout:
    """Create every group of the mesh (GROUPS, then the embedding group) over the initialized world; every rank
    must call this the same way.

    Mirrors `megatron-lm:megatron/core/parallel_state.py::initialize_model_parallel`.
    """
    if not dist.is_initialized():
        raise ParallelConfigError("torch.distributed is not initialized: call init_process_group first")
    tp, pp, dp = parallel_sizes(dist.get_world_size(), tp_size, pp_size, dp_size, cp_size)
    mesh = Mesh(tp, pp, dp, cp=cp_size, ep=ep_size, dp_replicate=dp_replicate, order=order)
    groups = {name: create_groups(mesh.ranks(name)) for name in (*GROUPS, "embedding")}
    return ParallelLayout(mesh, dist.get_rank(), groups)
