"""Bad input to the TP reference: one clear line naming the problem, a non-zero exit, never a hang."""

import pytest

from tests.launch import ROOT, WORKERS, run_worker, torchrun, torchrun_failing
from tests.reference.gpus import DEVICES

# Each case of the worker and what its one-line ParallelConfigError must say.
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ERRORS)
def test_bad_configurations_raise_one_line_errors(case, device):
    for result in run_worker("tp_bad_input_worker.py", 2, device=device, timeout=120):
        error = result["errors"][case]
        assert error is not None, f"{case}: no ParallelConfigError containing {ERRORS[case]!r} on rank {result['rank']}"
        assert ERRORS[case] in error and "\n" not in error, error


@pytest.mark.parametrize("device", DEVICES)
def test_sequence_padding_by_request_runs_and_keeps_the_length(device):
    for result in run_worker("tp_bad_input_worker.py", 2, device=device, timeout=120):
        assert result["padded_output_shape"] == [5, 1, 8]


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
    message, _ = torchrun_failing(WORKERS / "tp_crash_worker.py", 2)
    assert "simulated crash of rank 1" in message
    assert "unreachable on rank 0" not in message
