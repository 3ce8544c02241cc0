"""Bad input raises one clear ParallelConfigError naming the problem, identically on every rank (world 2)."""
import torch
import torch.distributed as dist

from common import finish, init
from reference.parallel_state import ParallelConfigError, build_layout
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.transformer import ParallelTransformer
from reference.tensor_parallel.unsharded import init_method_normal

device = init()
tp = build_layout(tp_size=2).tp_group


def expect_error(fragment: str, make):
    try:
        make()
    except ParallelConfigError as error:
        assert fragment in str(error) and "\n" not in str(error), str(error)
        return
    raise AssertionError(f"no ParallelConfigError containing {fragment!r}")


def column(**kw):
    return ColumnParallelLinear(8, 8, tp_group=tp, init_method=init_method_normal(), device=device, **kw)


expect_error("the world size (2) is not divisible by tp 3 x pp 1 (3)", lambda: build_layout(tp_size=3))
expect_error("num_attention_heads (3) is not divisible by the tensor-parallel size (2)",
             lambda: ParallelTransformer(1, 12, 3, tp_group=tp))
expect_error("hidden_size (18) is not divisible by num_attention_heads (4)",
             lambda: ParallelTransformer(1, 18, 4, tp_group=tp))
expect_error("ColumnParallelLinear output_size (7) is not divisible by the tensor-parallel size (2)",
             lambda: ColumnParallelLinear(8, 7, tp_group=tp, init_method=init_method_normal()))
expect_error("RowParallelLinear input_size (7) is not divisible",
             lambda: RowParallelLinear(7, 8, tp_group=tp, init_method=init_method_normal()))
expect_error("sequence_parallel requires input_is_parallel=True",
             lambda: RowParallelLinear(8, 8, tp_group=tp, init_method=init_method_normal(), sequence_parallel=True))
expect_error("input dtype torch.float64 does not match weight dtype torch.float32",
             lambda: column()(torch.ones(4, 2, 8, dtype=torch.float64, device=device)))
expect_error("input on meta but weight on", lambda: column()(torch.ones(4, 2, 8, device="meta")))
expect_error("input last dimension 6, expected 8", lambda: column()(torch.ones(4, 2, 6, device=device)))
model = ParallelTransformer(1, 8, 2, tp_group=tp, sequence_parallel=True, device=device)
expect_error("sequence length 5 is not divisible by the tensor-parallel size 2",
             lambda: model(torch.ones(5, 1, 8, device=device)))
# the same model with padding by request runs and keeps the sequence length
padded = ParallelTransformer(1, 8, 2, tp_group=tp, sequence_parallel=True, pad_sequence=True, device=device)
assert padded(torch.ones(5, 1, 8, device=device)).shape == (5, 1, 8)
print(f"rank {dist.get_rank()}: bad input ok", flush=True)
finish()
