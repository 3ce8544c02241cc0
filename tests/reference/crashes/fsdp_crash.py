"""Rank 1 dies in the middle of an FSDP training step; the other rank must not hang (torchrun tears it down)."""

import time

import torch.distributed as dist

from reference.distributed import init_distributed
from reference.fsdp.units import shard_model
from reference.gpt.model import GPT
from reference.gpt.train import split_batch, synthetic_batches
from tests.on_rank import every_rank_started
from tests.reference.fsdp_runs import BATCH, CONFIG, SEED, STEPS


def main() -> None:
    """Rank 1 fails inside its second step's forward; rank 0 is then blocked in a collective."""
    every_rank_started(300)  # the group's short timeout then bounds the crash, not the ranks' start
    device = init_distributed("cpu", 15)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = shard_model(GPT(CONFIG, SEED, device), "reference", dist.group.WORLD)
    calls = []

    def crash_on_rank1(module, args):
        calls.append(1)
        if rank == 1 and len(calls) == 2:
            raise RuntimeError("simulated rank crash: rank 1 failed in step 2")

    model.layers[1].register_forward_pre_hook(crash_on_rank1)
    for tokens in synthetic_batches(CONFIG, STEPS, BATCH, SEED):
        ((inputs, labels),) = split_batch(tokens.to(device), world, rank, 1)
        model(inputs, labels).backward()
    print(f"rank {rank} finished {time.time()}")


if __name__ == "__main__":
    main()
