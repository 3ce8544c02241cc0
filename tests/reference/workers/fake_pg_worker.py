"""One process posing as rank RANK of a WORLD-rank job (torch's `fake` backend: no communication), running a
TP=TP transformer step without and with sequence parallelism; writes each step's recorded collectives to
OUT/rank{RANK}.json ({"tp": ..., "sp": ...}). Usage: fake_pg_worker.py OUT RANK WORLD TP"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from common import write_results
from torch.testing._internal.distributed.fake_pg import FakeStore

from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import Transformer


def step(layout, tp: int, sp: bool) -> dict:
    model = parallelize(Transformer(1, 8 * tp, tp), layout, sequence_parallel=sp)
    x = torch.randn(2 * tp, 3, 8 * tp)  # s = 2 tp, b = 3, h = 8 tp
    with CollectiveRecorder() as rec:
        rec.watch(model)
        model(x).sum().backward()
    return {"tp_rank": layout.tp_rank, "events": rec.to_dict()["events"]}


def main() -> None:
    out, (rank, world, tp) = Path(sys.argv[1]), map(int, sys.argv[2:5])
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    layout = build_layout(tp)
    write_results(out, {"tp": step(layout, tp, sp=False), "sp": step(layout, tp, sp=True)})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
