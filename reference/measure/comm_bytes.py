"""`CommBytes`: PyTorch's `CommDebugMode`, which counts the collectives each module issues forward and
backward, keeping each counted collective's bytes too.

`CommDebugMode` counts per module (`comm_module_counts`) but records no sizes; this subclass records, for every
collective it counts, the module and phase `CommDebugMode` attributed it to, the collective's kind, and the
bytes of the whole tensor it works on (reference.measure.recorder's convention: an all-reduce's tensor, an
all-gather's output, a reduce-scatter's input). Counts and bytes thus share one attribution. It knows
DTensor's functional collectives, what a DTensor plan issues; another collective is refused by name.
"""

from __future__ import annotations

import dataclasses

from torch.distributed.tensor.debug import CommDebugMode

# functional collective -> (kind, multiply the input's bytes by the group size: the all-gather's output)
KINDS = {
    "_c10d_functional::all_reduce": ("all_reduce", False),
    "_c10d_functional::all_gather_into_tensor": ("all_gather", True),
    "_c10d_functional::reduce_scatter_tensor": ("reduce_scatter", False),
}


@dataclasses.dataclass(frozen=True)
class Counted:
    """One collective as CommDebugMode counted it: `module` is its fully qualified name ("Global" outside
    every module), `phase` "forward" or "backward"."""

    module: str
    phase: str
    kind: str
    nbytes: int


class CommBytes(CommDebugMode):
    """`with CommBytes() as comm: ...`, then `comm.counted` (a list of Counted, in issue order) beside
    CommDebugMode's own `comm_module_counts`."""

    def __init__(self) -> None:
        super().__init__()
        self.counted: list[Counted] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:
            name = func._schema.name
            if name not in KINDS:
                raise NotImplementedError(f"CommBytes knows no sizes of {name}; add it to KINDS")
            kind, gathered = KINDS[name]
            tensor = args[0]
            nbytes = tensor.nbytes * (args[1] if gathered else 1)  # all_gather_into_tensor(input, group_size, ...)
            tracker = self.advanced_module_tracker
            phase = "backward" if tracker.is_bw else "forward"
            self.counted.append(Counted(tracker.name, phase, kind, nbytes))
        return out
