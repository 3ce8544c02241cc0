"""The data-parallel mesh of the per-parameter FSDP: the group a parameter is sharded over and, for HSDP, the
group it is replicated over.

The layout is one readable grid, `torch.arange(world).view(replicas, shards)`: each row a shard group
(consecutive ranks), each column a replicate group. `ShardMesh.flat(group)` is FSDP (one row);
`ShardMesh.hsdp(replicas)` is HSDP, what `fully_shard` does on a 2-D `DeviceMesh` with dims (replicate,
shard); `ShardMesh.from_device_mesh` reads those groups off a `DeviceMesh`. `post_forward(k)` is the smaller
mesh `reshard_after_forward=k` keeps its shards on between forward and backward.

Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_common.py::FSDPMeshInfo` and
`pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_common.py::HSDPMeshInfo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(eq=False)
class ShardMesh:
    """`grid[r][s]` is the global rank at replica r, shard s; this rank's row is `shard_group`, its column
    `replicate_group` (None without replicas). Every rank builds the same grid (the groups are collectives)."""

    grid: tuple[tuple[int, ...], ...]
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None = None
    _post_forward: dict[int, ShardMesh] = field(default_factory=dict, repr=False)

    @property
    def shard_size(self) -> int:
        return len(self.grid[0])

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard_group)

    @property
    def replicas(self) -> int:
        return len(self.grid)

    @classmethod
    def flat(cls, group: dist.ProcessGroup | None = None) -> ShardMesh:
        """FSDP: shard over `group` (default: every rank), no replicas."""
        group = group or dist.group.WORLD
        return cls((tuple(dist.get_process_group_ranks(group)),), group)

    @classmethod
    def hsdp(cls, replicas: int, group: dist.ProcessGroup | None = None) -> ShardMesh:
        """HSDP: `group`'s ranks as `replicas` rows of consecutive ranks; shard within a row, replicate down a
        column. A collective: every rank of the default group creates every row's and every column's group."""
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        if replicas < 1 or len(ranks) % replicas:
            raise ValueError(f"HSDP over {len(ranks)} ranks needs a replica count dividing it, got {replicas}")
        _refuse_part_of_the_world(ranks, "HSDP")
        grid = torch.tensor(ranks).view(replicas, -1)
        shard_group, _ = dist.new_subgroups_by_enumeration(grid.tolist())
        replicate_group, _ = dist.new_subgroups_by_enumeration(grid.t().tolist())
        return cls(tuple(map(tuple, grid.tolist())), shard_group, replicate_group)

    @classmethod
    def from_device_mesh(cls, mesh) -> ShardMesh:
        """The groups of a 1-D `DeviceMesh` (shard) or a 2-D one (replicate, shard), as `fully_shard` reads it
        (`pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_init.py::_get_mesh_info`)."""
        if mesh.ndim == 1:
            return cls((tuple(mesh.mesh.tolist()),), mesh.get_group(0))
        if mesh.ndim == 2:
            return cls(tuple(map(tuple, mesh.mesh.tolist())), mesh.get_group(1), mesh.get_group(0))
        raise ValueError(f"a data-parallel mesh has 1 or 2 dimensions (shard, or replicate x shard), got {mesh.ndim}")

    def post_forward(self, size: int) -> ShardMesh:
        """The mesh `reshard_after_forward=size` reshards to: the whole grid in rows of `size` consecutive ranks
        (made once per size: a collective on first use).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_init.py::_get_post_forward_mesh_info`.
        """
        if size not in self._post_forward:
            _refuse_part_of_the_world([rank for row in self.grid for rank in row], "reshard_after_forward=int")
            rows = torch.tensor(self.grid).view(-1, size).tolist()
            group, _ = dist.new_subgroups_by_enumeration(rows)
            self._post_forward[size] = ShardMesh(tuple(map(tuple, rows)), group)
        return self._post_forward[size]


def _refuse_part_of_the_world(ranks: list[int], what: str) -> None:
    """new_group is a collective of the whole world, in one order on every rank: groups cut from one DP group
    alone would be created in a different order by the ranks of another DP group (a hang). Under TP or PP,
    reference.data_parallel.fsdp2_tp.hsdp_mesh cuts every DP group's rows and columns in one order."""
    if len(ranks) != dist.get_world_size():
        raise ValueError(
            f"{what} over {len(ranks)} of {dist.get_world_size()} ranks: cut every data-parallel group's groups "
            "at once (reference.data_parallel.fsdp2_tp.hsdp_mesh)"
        )
