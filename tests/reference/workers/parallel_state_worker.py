"""reference.parallel_state against megatron-core's initialize_model_parallel at world 4: same groups."""
import torch
import torch.distributed as dist

from common import init

device = init()
if device.type == "cpu":
    torch.cuda.current_device = lambda: "cpu"

from megatron.core import parallel_state as mpu  # noqa: E402

from reference.parallel_state import build_layout  # noqa: E402

rank = dist.get_rank()
for tp, pp in [(2, 1), (4, 1), (2, 2), (1, 2)]:
    layout = build_layout(tp, pp)
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    for name, ours, theirs in [("tp", layout.tp_group, mpu.get_tensor_model_parallel_group()),
                               ("dp", layout.dp_group, mpu.get_data_parallel_group()),
                               ("pp", layout.pp_group, mpu.get_pipeline_model_parallel_group())]:
        mine, megatron = dist.get_process_group_ranks(ours), dist.get_process_group_ranks(theirs)
        assert mine == megatron, f"tp={tp} pp={pp} {name} group of rank {rank}: {mine} vs megatron {megatron}"
    assert layout.tp_rank == mpu.get_tensor_model_parallel_rank() and layout.dp_rank == mpu.get_data_parallel_rank()
    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total, group=layout.tp_group)  # the group really is the consecutive ranks
    first = rank - rank % tp
    assert total.item() == sum(range(first, first + tp))
    mpu.destroy_model_parallel()
    if rank == 0:
        print(layout.describe(), flush=True)
print(f"rank {rank}: parallel_state ok", flush=True)
dist.destroy_process_group()
