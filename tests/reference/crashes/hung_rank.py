"""Rank 1 stops itself (SIGSTOP) in its second step, as a debugger or a frozen node would: its sockets stay open,
so rank 0 waits in a collective; the heartbeat must end the job within the timeout ($REFERENCE_TIMEOUT_S)."""

import os
import signal
import time

import torch
import torch.distributed as dist

from reference.distributed import init_distributed
from reference.gpt.model import gpt_blocks
from reference.parallel_state import build_layout
from reference.tensor_parallel.parallelize import parallelize
from tests.on_rank import every_rank_started


def main() -> None:
    every_rank_started(300)  # the 4 s timeout then bounds rank 1's stop, not the ranks' start on a busy machine
    device = init_distributed("cpu")
    tp = build_layout(tp_size=dist.get_world_size()).tp_group
    model = parallelize(gpt_blocks(2, 16, 4, device=device), tp)
    for step in range(3):
        loss = model(None, None, hidden=torch.randn(8, 2, 16, device=device)).square().sum()
        if step == 1 and dist.get_rank() == 1:
            print(f"rank 1 stops at {time.time()}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        loss.backward()  # rank 0 blocks in the backward all-reduce its stopped peer never joins
    print("unreachable on rank 0: finished all steps", flush=True)


if __name__ == "__main__":
    main()
