"""The data-parallel mesh of the per-parameter FSDP: the group a parameter is sharded over and, for HSDP, the
group it is replicated over.

The groups are the layout's (reference.parallel_state, where every group of a run is made):
`ShardMesh.from_layout(layout)` shards over the DP group, or under HSDP (`dp_replicate` > 1) over `dp_shard`
and replicates over `dp_replicate`, what `fully_shard` does on a 2-D `DeviceMesh` with dims (replicate, shard).
`ShardMesh.flat(group)` shards over a group that exists; `ShardMesh.from_device_mesh` reads a `DeviceMesh`'s
groups. `post_forward(k)` is the smaller mesh `reshard_after_forward=k` keeps its shards on between forward and
backward.

Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_common.py::FSDPMeshInfo` and
`pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_common.py::HSDPMeshInfo`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist

from reference.parallel_state import create_groups

if TYPE_CHECKING:
    from reference.parallel_state import ParallelLayout


@dataclass(eq=False)
class ShardMesh:
    """`grid[r][s]` is the global rank at replica r, shard s; this rank's row is `shard_group`, its column
    `replicate_group` (None without replicas)."""

    grid: tuple[tuple[int, ...], ...]
    shard_group: dist.ProcessGroup
    replicate_group: dist.ProcessGroup | None = None
    every: tuple[tuple[int, ...], ...] | None = None  # every shard group of the world (None: `grid`'s rows)
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
    def from_layout(cls, layout: ParallelLayout) -> ShardMesh:
        """FSDP2's view of a layout: shard over its DP group, or under HSDP over `dp_shard` with the replicas
        over `dp_replicate` (this rank's DP group as `dp_replicate` rows of consecutive DP ranks).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_common.py::HSDPMeshInfo`.
        """
        if layout.size("dp_replicate") == 1:
            return cls((layout.members("dp"),), layout.dp_group, every=_rows(layout.ranks("dp")))
        grid = _rows(layout.local(("dp_replicate", "dp_shard")).tolist())
        shard, replicate = layout.group("dp_shard"), layout.group("dp_replicate")
        return cls(grid, shard, replicate, every=_rows(layout.ranks("dp_shard")))

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
        """The mesh `reshard_after_forward=size` reshards to: every shard group of the world in rows of `size`
        consecutive ranks (made once per size, on first use; refused when this mesh does not know every
        shard group of the world).

        Mirrors `pytorch:torch/distributed/fsdp/_fully_shard/_fsdp_init.py::_get_post_forward_mesh_info`.
        """
        if size not in self._post_forward:
            rows = [row[i : i + size] for row in self.every or self.grid for i in range(0, len(row), size)]
            group = create_groups(rows, "reshard_after_forward=int")
            mine = next(row for row in rows if dist.get_rank() in row)
            self._post_forward[size] = ShardMesh((mine,), group)
        return self._post_forward[size]


def _rows(lists: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(map(tuple, lists))
