"""Bad input to the TP reference: one clear line naming the problem, a non-zero exit, never a hang.

The configuration errors run on both ranks of a world-2 launch and assert there; the demo's refusal and a
rank's crash are torchrun launches of their own (the crash must end its job)."""

import pytest
import torch

from reference.gpt.model import gpt_blocks
from reference.parallel_state import ParallelConfigError, build_layout
from reference.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from reference.tensor_parallel.parallelize import parallelize
from reference.tensor_parallel.transformer import init_method_normal
from tests.launch import CRASHES, ROOT, torchrun, torchrun_failing
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES

# Each case and what its one-line ParallelConfigError must say.
ERRORS = {
    "tp_3": "the world size (2) is not divisible by tp 3 x pp 1 (3)",
    "heads_3": "num_attention_heads (3) is not divisible by the tensor-parallel size (2)",
    "hidden_18": "hidden_size (18) is not divisible by num_attention_heads (4)",
    "column_output_7": "ColumnParallelLinear output_size (7) is not divisible by the tensor-parallel size (2)",
    "row_input_7": "RowParallelLinear input_size (7) is not divisible",
    "row_sp_input_not_parallel": "sequence_parallel requires input_is_parallel=True",
    "float64_input": "input dtype torch.float64 does not match weight dtype torch.float32",
    "meta_input": "input on meta but weight on",
    "last_dimension_6": "input last dimension 6, expected 8",
    "sequence_5": "sequence length 5 is not divisible by the tensor-parallel size 2",
    "split_twice": "TransformerBlock is already split over a TP group; parallelize it once",
}


def make(case: str, device: torch.device):
    """What raises `case`'s error, at TP 2 on `device`."""
    tp = build_layout(tp_size=2).tp_group

    def column(**kw):
        return ColumnParallelLinear(8, 8, tp_group=tp, init_method=init_method_normal(), device=device, **kw)

    def model():
        return parallelize(gpt_blocks(1, 8, 2, device=device), tp, sequence_parallel=True)

    return {
        "tp_3": lambda: build_layout(tp_size=3),
        "heads_3": lambda: parallelize(gpt_blocks(1, 12, 3), tp),
        "hidden_18": lambda: parallelize(gpt_blocks(1, 18, 4), tp),
        "column_output_7": lambda: ColumnParallelLinear(8, 7, tp_group=tp, init_method=init_method_normal()),
        "row_input_7": lambda: RowParallelLinear(7, 8, tp_group=tp, init_method=init_method_normal()),
        "row_sp_input_not_parallel": lambda: RowParallelLinear(
            8, 8, tp_group=tp, init_method=init_method_normal(), sequence_parallel=True
        ),
        "float64_input": lambda: column()(torch.ones(4, 2, 8, dtype=torch.float64, device=device)),
        "meta_input": lambda: column()(torch.ones(4, 2, 8, device="meta")),
        "last_dimension_6": lambda: column()(torch.ones(4, 2, 6, device=device)),
        "sequence_5": lambda: model()(None, None, hidden=torch.ones(5, 1, 8, device=device)),
        "split_twice": lambda: parallelize(model(), tp),
    }[case]


@on_ranks(2, devices=DEVICES)
@pytest.mark.parametrize("case", ERRORS)
def test_bad_configurations_raise_one_line_errors(ranks, case):
    with pytest.raises(ParallelConfigError) as error:
        make(case, ranks.device)()
    assert ERRORS[case] in str(error.value) and "\n" not in str(error.value), f"{case} on rank {ranks.rank}"


@on_ranks(2, devices=DEVICES)
def test_sequence_padding_by_request_runs_and_keeps_the_length(ranks):
    tp = build_layout(tp_size=2).tp_group
    padded = parallelize(gpt_blocks(1, 8, 2, device=ranks.device), tp, sequence_parallel=True, pad_sequence=True)
    assert padded(None, None, hidden=torch.ones(5, 1, 8, device=ranks.device)).shape == (5, 1, 8)


def test_demo_refuses_world_not_divisible_by_tp_with_one_line_error():
    with pytest.raises(pytest.fail.Exception) as failure:
        # 6 heads: tp 3 splits them, so the refusal is the world's (the heads are checked before launch)
        torchrun(
            ROOT / "reference" / "__main__.py",
            2,
            "--tp",
            "3",
            "--num-attention-heads",
            "6",
            "--hidden-size",
            "48",
            timeout=120,
        )
    message = str(failure.value)
    assert "exited 1" in message or "exited 2" in message, message[-2000:]
    assert "reference: error: the world size (2) is not divisible by tp 3 x pp 1 (3)" in message
    assert "[rank0]: Traceback" not in message and "[rank1]: Traceback" not in message


def test_rank_crash_mid_step_ends_the_run_in_bounded_time():
    message, _ = torchrun_failing(CRASHES / "tp_crash.py", 2)
    assert "simulated crash of rank 1" in message
    assert "unreachable on rank 0" not in message
