"""The TP note's claims, shown on megatron-core 0.16.1 itself (ColumnParallelLinear / RowParallelLinear).

One torchrun launch at world 2 on CPU/gloo (tests/reference/workers/megatron_claims_worker.py) runs every
configuration once; each test reads both ranks' records. Layers use megatron's ModelParallelConfig defaults
except use_cpu_initialization=True (the GPU path needs CUDA). Shapes: input [s, b, h] = [4, 3, 12] in fp32,
output size 20, so the column layer's dX GEMM gives [12, 12], its dW GEMM [10, 12].
"""

from __future__ import annotations

import pytest
import torch

from tests.launch import run_worker

pytestmark = pytest.mark.upstream("megatron-lm")

WORLD, S, B, IN, OUT = 2, 4, 3, 12, 20
ACTIVATION_BYTES = S * B * IN * 4  # one full [s, b, h] fp32 activation


def records() -> list[dict]:
    """Both ranks' records of the one worker launch."""
    return run_worker("megatron_claims_worker.py", WORLD, timeout=240)


def cases(name: str) -> list[dict]:
    return [r[name] for r in records()]


def ops(case: dict, phase: str) -> list[tuple]:
    """(op, output shape) of the GEMMs, additions and collectives of one phase, in issue order."""
    return [(o["op"], o["shape"]) for o in case["ops"] if o["phase"] == phase]


def collectives(case: dict, phase: str | None = None) -> list[tuple]:
    return [(e["op"], e["nbytes"], e["async_op"]) for e in case["events"] if phase in (None, e["phase"])]


def tensor(values) -> torch.Tensor:
    return torch.tensor(values)


def inputs() -> torch.Tensor:
    return torch.randn(S, B, IN, generator=torch.Generator().manual_seed(4))


def test_column_defaults_allreduce_dx_async_between_dx_and_dw_gemms():
    """TP 2, defaults: no collective in forward; in backward dX's GEMM, then its all-reduce issued with
    async_op=True, then the dW GEMM, and only then the wait."""
    for case in cases("column"):
        assert case["allreduce_dgrad"] is True
        assert collectives(case, "forward") == []
        assert ops(case, "backward") == [
            ("aten::mm", [S * B, IN]),
            ("c10d::allreduce_", None),
            ("aten::mm", [OUT // WORLD, IN]),
        ]
        assert collectives(case, "backward") == [("all_reduce", ACTIVATION_BYTES, True)]
        dw_gemm = case["ops"][-1]
        (event,) = case["events"]
        assert event["start"] < dw_gemm["t"] and event["end"] >= dw_gemm["end"], (event, dw_gemm)
        assert case["dx_equal_across_ranks"]


def test_async_tensor_model_parallel_allreduce_is_ignored():
    """The old config flag changes nothing: dX's all-reduce is still issued asynchronously in the kernel."""
    for plain, flag_off in zip(cases("column"), cases("column_async_flag_off")):
        assert flag_off["allreduce_dgrad"] is True
        assert collectives(flag_off) == collectives(plain) == [("all_reduce", ACTIVATION_BYTES, True)]
        assert ops(flag_off, "backward") == ops(plain, "backward")


def test_column_input_enters_the_kernel_unwrapped_f_only_at_tp1():
    """At TP > 1 (defaults, disable_grad_reduce, expert, sequence parallel) no copy_to region sits between the
    input and the kernel; at TP 1 the f operator is there, and communicates nothing."""
    for name in ("column", "column_disable_grad_reduce", "column_expert", "column_sp"):
        for case in cases(name):
            assert case["chain"] == ["LinearWithGradAccumulationAndAsyncCommunicationBackward", "AccumulateGrad"], name
    for case in cases("column_tp1"):
        assert case["chain"] == [
            "LinearWithGradAccumulationAndAsyncCommunicationBackward",
            "_CopyToModelParallelRegionBackward",
            "AccumulateGrad",
        ]
        assert case["allreduce_dgrad"] is False and collectives(case) == []


def test_disable_grad_reduce_and_expert_layers_leave_dx_unreduced():
    """disable_grad_reduce clears allreduce_dgrad; an expert layer keeps the attribute but its forward passes
    False: either way no collective runs and each rank keeps its partial dX."""
    disabled, expert = cases("column_disable_grad_reduce"), cases("column_expert")
    assert [c["allreduce_dgrad"] for c in disabled] == [False] * WORLD
    assert [c["allreduce_dgrad"] for c in expert] == [True] * WORLD
    for case in disabled + expert:
        assert collectives(case) == [] and not case["dx_equal_across_ranks"]
    partial_sum = sum(tensor(c["dx"]) for c in disabled)
    torch.testing.assert_close(partial_sum, tensor(cases("column")[0]["dx"]))


def test_sequence_parallel_gathers_input_in_forward_and_again_in_backward_then_reduce_scatters_dx():
    for case in cases("column_sp"):
        assert case["allreduce_dgrad"] is False
        assert case["saved"][0] == [S // WORLD, B, IN], "autograd keeps the sequence shard, not the gathered input"
        assert collectives(case, "forward") == [("all_gather", ACTIVATION_BYTES, False)]
        assert collectives(case, "backward") == [
            ("all_gather", ACTIVATION_BYTES, True),
            ("reduce_scatter", ACTIVATION_BYTES, True),
        ]
        assert ops(case, "backward") == [
            ("c10d::_allgather_base_", None),
            ("aten::mm", [S * B, IN]),
            ("c10d::_reduce_scatter_base_", None),
            ("aten::mm", [OUT // WORLD, IN]),
        ]
        _, dx_gemm, _, dw_gemm = [o for o in case["ops"] if o["phase"] == "backward"]
        regather, reduce_scatter = [e for e in case["events"] if e["phase"] == "backward"]
        assert regather["end"] >= dx_gemm["end"], "the re-gather is waited after the dX GEMM"
        assert reduce_scatter["end"] >= dw_gemm["end"], "dX's reduce-scatter is waited after the dW GEMM"


def test_row_sequence_parallel_reduce_scatters_what_it_would_all_reduce():
    """The row layer's forward all-reduce becomes a reduce-scatter of the same tensor; backward all-gathers dY."""
    for plain, sp in zip(cases("row"), cases("row_sp")):
        row_bytes = S * B * OUT * 4
        assert collectives(plain) == [("all_reduce", row_bytes, False)]
        assert collectives(sp, "forward") == [("reduce_scatter", row_bytes, False)]
        assert collectives(sp, "backward") == [("all_gather", row_bytes, False)]


def column_expected(rank: int, with_bias: bool) -> torch.Tensor:
    case = cases("column")[rank]
    shard = tensor(case["master"]).chunk(WORLD, 0)[rank]
    bias = tensor(case["full_bias"]).chunk(WORLD)[rank]
    return inputs() @ shard.t() + (bias if with_bias else 0)


def test_column_bias_is_sharded_and_added_after_the_matmul():
    for rank, case in enumerate(cases("column")):
        assert case["bias_shape"] == [OUT // WORLD]
        assert ops(case, "forward") == [("aten::mm", [S * B, OUT // WORLD]), ("aten::add", [S, B, OUT // WORLD])]
        torch.testing.assert_close(tensor(case["output"]), column_expected(rank, with_bias=True))


def row_expected(with_bias: bool) -> torch.Tensor:
    case = cases("row")[0]
    return inputs() @ tensor(case["master"]).t() + (tensor(case["full_bias"]) if with_bias else 0)


def test_row_bias_is_replicated_and_added_once_after_the_allreduce():
    for case in cases("row"):
        assert case["bias_shape"] == [OUT]
        assert ops(case, "forward") == [
            ("aten::mm", [S * B, OUT]),
            ("c10d::allreduce_", None),
            ("aten::add", [S, B, OUT]),
        ]
        torch.testing.assert_close(tensor(case["output"]), row_expected(with_bias=True))
    for rank, case in enumerate(cases("row_sp")):  # sequence parallel: added to this rank's sequence slice
        assert ops(case, "forward")[-1] == ("aten::add", [S // WORLD, B, OUT])
        torch.testing.assert_close(tensor(case["output"]), row_expected(with_bias=True).chunk(WORLD)[rank])


def test_row_allreduce_is_an_autograd_function_all_reduce_forward_identity_backward():
    """The row layer's output passes _ReduceFromModelParallelRegion: all-reduced in forward, its gradient passed
    through untouched, so the row backward issues no collective and each rank's dX is its slice of the full dX."""
    full_dx = torch.ones(S, B, OUT) @ tensor(cases("row")[0]["master"])
    for rank, case in enumerate(cases("row")):
        assert case["chain"][:2] == ["AddBackward0", "_ReduceFromModelParallelRegionBackward"]
        assert collectives(case, "forward") == [("all_reduce", S * B * OUT * 4, False)]
        assert collectives(case, "backward") == []
        torch.testing.assert_close(tensor(case["dx"]), full_dx.chunk(WORLD, dim=-1)[rank])


def test_skip_bias_add_returns_the_bias_unadded_column_and_row():
    for rank, case in enumerate(cases("column_skip_bias_add")):
        assert ("aten::add", [S, B, OUT // WORLD]) not in ops(case, "forward")
        torch.testing.assert_close(tensor(case["output"]), column_expected(rank, with_bias=False))
        torch.testing.assert_close(
            tensor(case["output_bias"]), tensor(cases("column")[rank]["full_bias"]).chunk(WORLD)[rank]
        )
    for case in cases("row_skip_bias_add"):
        assert [op for op, _ in ops(case, "forward")] == ["aten::mm", "c10d::allreduce_"]
        torch.testing.assert_close(tensor(case["output"]), row_expected(with_bias=False))
        torch.testing.assert_close(tensor(case["output_bias"]), tensor(cases("row")[0]["full_bias"]))


def test_cpu_initialization_builds_the_master_weight_and_keeps_strided_pieces():
    """Every rank draws the same full [out, in] master; with stride 2 it splits it into pieces of
    out / p / 2 rows and keeps pieces rank, rank + p, ...: not the contiguous chunk. The shard is a tagged
    Parameter with storage of its own."""
    inits = [r["init"] for r in records()]
    masters = [tensor(i["master"]) for i in inits]
    assert masters[0].shape == (OUT, IN) and all(torch.equal(m, masters[0]) for m in masters)
    pieces = masters[0].split(OUT // WORLD // 2, dim=0)
    for rank, init in enumerate(inits):
        assert (init["tensor_model_parallel"], init["partition_dim"], init["partition_stride"]) == (True, 0, 2)
        assert init["storage_bytes"] == OUT // WORLD * IN * 4, "its own [out/p, in] storage, not a view of the master"
        weight = tensor(init["weight"])
        assert torch.equal(weight, torch.cat(pieces[rank::WORLD]))
        assert not torch.equal(weight, masters[0].chunk(WORLD)[rank])


def test_gradient_accumulation_fusion_requires_the_apex_cuda_kernel():
    for record in records():
        assert "fused_weight_gradient_mlp_cuda" in record["fusion_without_apex"]
        assert "APEX" in record["fusion_without_apex"]


def test_gradient_accumulation_fusion_hands_the_kernel_dy_x_and_main_grad_by_dtype():
    """With a stand-in for the APEX module: megatron passes (X, dY, main_grad) with main_grad shaped like the
    [out, in] weight, so what accumulates is dY^T X; the entry point follows main_grad's dtype; autograd
    gets no weight gradient, and two micro-batches sum in main_grad."""
    for record in records():
        for name, variant, dtype in (
            ("fusion_fp32", "fp32", "torch.float32"),
            ("fusion_bf16", "fp16", "torch.bfloat16"),
        ):
            case = record[name]
            assert (
                case["calls"]
                == [
                    {
                        "variant": variant,
                        "total_input": [S * B, IN],
                        "grad_output": [S * B, OUT // WORLD],
                        "main_grad": [OUT // WORLD, IN],
                        "main_grad_dtype": dtype,
                    }
                ]
                * 2
            )
            assert case["grad_is_none"]
        torch.testing.assert_close(
            tensor(record["fusion_fp32"]["main_grad"]), tensor(record["fusion_fp32"]["expected_main_grad"])
        )


def test_gradient_accumulation_fusion_gives_autograd_a_placeholder_under_megatron_ddp():
    """A weight carrying megatron DDP's grad_added_to_main_grad gets a placeholder .grad of the weight's shape
    (so DDP's hooks still fire) and the flag set, telling the hook not to add it to main_grad again."""
    for record in records():
        case = record["fusion_ddp"]
        assert case["grad_shape"] == [OUT // WORLD, IN] and case["grad_added_to_main_grad"] is True
        torch.testing.assert_close(tensor(case["main_grad"]), tensor(case["expected_main_grad"]))


def test_megatron_fsdp_weight_takes_a_plain_matmul_not_the_apex_kernel():
    for record in records():
        case = record["fusion_megatron_fsdp"]
        assert case["calls"] == [] and case["grad_is_none"]
        torch.testing.assert_close(tensor(case["main_grad"]), tensor(case["expected_main_grad"]))
