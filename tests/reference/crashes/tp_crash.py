"""Rank 1 dies in the middle of a training step; the other rank must not hang (torchrun tears it down)."""

import torch
import torch.distributed as dist

from reference.distributed import init_distributed
from reference.gpt.model import gpt_blocks
from reference.parallel_state import build_layout
from reference.tensor_parallel.parallelize import parallelize
from tests.on_rank import every_rank_started


def main() -> None:
    every_rank_started(300)  # the group's short timeout then bounds the crash, not the ranks' start
    device = init_distributed("cpu", 30)
    tp = build_layout(tp_size=dist.get_world_size()).tp_group
    model = parallelize(gpt_blocks(2, 16, 4, device=device), tp)
    for step in range(3):
        loss = model(None, None, hidden=torch.randn(8, 2, 16, device=device)).square().sum()
        if step == 1 and dist.get_rank() == 1:
            raise RuntimeError("simulated crash of rank 1 between forward and backward")
        loss.backward()  # rank 0 blocks in the backward all-reduce its peer never joins
    print("unreachable on rank 0: finished all steps", flush=True)


if __name__ == "__main__":
    main()
