"""Stage 1 dies in the backward of micro-batch 1; stage 0, waiting for that gradient, must not hang."""

import torch
import torch.distributed as dist

from reference.distributed import init_distributed
from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import build_stage
from reference.gpt.train import data_parallel, synthetic_batches, train_step
from reference.parallel_state import build_layout
from tests.on_rank import every_rank_started


def main() -> None:
    every_rank_started(300)  # the group's short timeout then bounds the crash, not the ranks' start
    device = init_distributed("cpu", 30)
    config = GPTConfig(vocab_size=32, hidden_size=16, num_attention_heads=4, num_layers=2, seq_length=8)
    layout = build_layout(1, 2, 1)
    stage = build_stage(config, layout, device=device)
    backwards = []

    def crash(*_):
        backwards.append(1)
        if len(backwards) == 2:
            raise RuntimeError("simulated crash of stage 1 in the backward of micro-batch 1")

    if layout.pp_rank == 1:
        stage.layers[0].register_full_backward_pre_hook(crash)
    tokens = synthetic_batches(config, 1, 4, seed=0)[0]
    model = data_parallel(stage, layout)
    train_step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        tokens,
        layout,
        num_micro_batches=4,
        schedule="1f1b",
        device=device,
    )
    print(f"unreachable on rank {dist.get_rank()}: the step finished", flush=True)


if __name__ == "__main__":
    main()
