"""The TP note's claims, shown on megatron-core 0.16.1 itself (ColumnParallelLinear / RowParallelLinear).

At world 2 on CPU/gloo, the first test to ask runs megatron's layers in every configuration the note describes
(`records()`, once a rank, gathered so each rank sees both) and keeps, per case: collectives
(CollectiveRecorder), GEMMs and bias additions in issue order, the autograd nodes between output and input, the
shapes autograd saved, and the numbers. Layers use megatron's ModelParallelConfig defaults except
use_cpu_initialization=True (the GPU path needs CUDA); buffers megatron allocates on
torch.cuda.current_device() are redirected to the CPU. Shapes: input [s, b, h] = [4, 3, 12] in fp32, output
size 20, so the column layer's dX GEMM gives [12, 12], its dW GEMM [10, 12].
"""

from __future__ import annotations

import functools
import time

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import layers
from torch.utils._python_dispatch import TorchDispatchMode

from reference.measure.recorder import CollectiveRecorder, current_phase
from reference.measure.torch_patches import cuda_calls_on_cpu
from tests.ranks import on_ranks
from tests.reference.helpers import every_rank, megatron_parallel_state

pytestmark = pytest.mark.upstream("megatron-lm")

WORLD, S, B, IN, OUT = 2, 4, 3, 12, 20  # GEMM outputs differ in shape: dX [S*B, IN], dW [OUT/p, IN] or [OUT, IN/p]
ACTIVATION_BYTES = S * B * IN * 4  # one full [s, b, h] fp32 activation
OPS = {"aten::mm", "aten::addmm", "aten::add", "aten::add_"}


class OpLog(TorchDispatchMode):
    """GEMMs, additions and collectives in issue order, with the perf_counter times each began and returned."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        if name in OPS or name.startswith("c10d::"):
            shape = list(out.shape) if isinstance(out, torch.Tensor) else None
            self.ops.append(
                {"op": name, "shape": shape, "t": start, "end": time.perf_counter(), "phase": current_phase()}
            )
        return out


def init_method(weight):
    torch.nn.init.normal_(weight, std=0.02)


def config(**overrides):
    """megatron's defaults, except CPU initialization (its GPU path needs CUDA) and what a case changes."""
    return ModelParallelConfig(
        tensor_model_parallel_size=dist.get_world_size(), use_cpu_initialization=True, **overrides
    )


def autograd_chain(output):
    """Names of the autograd nodes from the output back to the input, following each node's first input."""
    names, node = [], output.grad_fn
    while node is not None:
        names.append(type(node).__name__)
        node = node.next_functions[0][0] if node.next_functions else None
    return names


def gathered(t, group):
    """Every rank's `t` in `group`, in rank order."""
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    return parts


def run_case(layer, x, group):
    """One forward and backward of `layer` on `x`, recorded."""
    x = x.clone().requires_grad_()
    saved = []
    with (
        CollectiveRecorder() as rec,
        OpLog() as log,
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(list(t.shape)) or t, lambda t: t),
    ):
        out, out_bias = layer(x)
        chain = autograd_chain(out)
        out.backward(torch.ones_like(out))
    t0 = min([e.start for e in rec.events] + [o["t"] for o in log.ops])
    events = [
        {
            "op": e.op,
            "nbytes": e.nbytes,
            "async_op": e.async_op,
            "phase": e.phase,
            "start": e.start - t0,
            "end": e.end - t0,
        }
        for e in rec.events
    ]
    dx_parts = gathered(x.grad, group) if group.size() > 1 else [x.grad]
    return {
        "events": events,
        "ops": [{**o, "t": o["t"] - t0, "end": o["end"] - t0} for o in log.ops],
        "chain": chain,
        "saved": saved,
        "allreduce_dgrad": getattr(layer, "allreduce_dgrad", None),
        "output": out.tolist(),
        "output_bias": None if out_bias is None else out_bias.tolist(),
        "bias_shape": list(layer.bias.shape),
        "dx": x.grad.tolist(),
        "dx_equal_across_ranks": all(torch.equal(p, dx_parts[0]) for p in dx_parts),
    }


def column(group=None, **kwargs):
    """megatron's ColumnParallelLinear on `group` (default: the TP group), seeded, with bias values."""
    group = group or parallel_state.get_tensor_model_parallel_group()
    cfg = config(
        **{k: kwargs.pop(k) for k in ("sequence_parallel", "async_tensor_model_parallel_allreduce") if k in kwargs}
    )
    torch.manual_seed(1)
    layer = layers.ColumnParallelLinear(
        IN, OUT, config=cfg, init_method=init_method, tp_group=group, keep_master_weight_for_test=True, **kwargs
    )
    return with_bias_values(layer, group)


def row(**kwargs):
    """megatron's RowParallelLinear on the TP group, seeded, with bias values."""
    tp = parallel_state.get_tensor_model_parallel_group()
    cfg = config(**{k: kwargs.pop(k) for k in ("sequence_parallel",) if k in kwargs})
    torch.manual_seed(2)
    layer = layers.RowParallelLinear(
        IN,
        OUT,
        config=cfg,
        init_method=init_method,
        tp_group=tp,
        bias=True,
        input_is_parallel=True,
        keep_master_weight_for_test=True,
        **kwargs,
    )
    return with_bias_values(layer, tp, sharded=False)


def with_bias_values(layer, group, sharded=True):
    """Both layers zero their bias; give it values (FULL_BIAS, or this rank's slice of it) so its handling shows."""
    with torch.no_grad():
        layer.bias.copy_(FULL_BIAS.chunk(group.size())[group.rank()] if sharded else FULL_BIAS)
    return layer


FULL_BIAS = torch.randn(OUT, generator=torch.Generator().manual_seed(3))
X = torch.randn(S, B, IN, generator=torch.Generator().manual_seed(4))


def master(layer):
    return layer.master_weight.tolist()


def layer_cases() -> dict:
    """Each case: one recorded forward and backward of megatron's layer."""
    tp = parallel_state.get_tensor_model_parallel_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    x_seq = X.chunk(world, dim=0)[rank]  # sequence-parallel input: this rank's slice of the sequence
    x_hidden = X.chunk(world, dim=-1)[rank]  # row-parallel input: this rank's slice of the hidden dimension
    cases = {}
    # the f operator and the dX all-reduce
    col = column()
    cases["column"] = {**run_case(col, X, tp), "master": master(col), "full_bias": FULL_BIAS.tolist()}
    solo = dist.new_subgroups(1)[0]  # a TP group of one: this rank alone
    cases["column_tp1"] = run_case(column(group=solo), X, solo)
    cases["column_async_flag_off"] = run_case(column(async_tensor_model_parallel_allreduce=False), X, tp)
    cases["column_disable_grad_reduce"] = run_case(column(disable_grad_reduce=True), X, tp)
    cases["column_expert"] = run_case(column(is_expert=True), X, tp)
    # sequence parallelism
    cases["column_sp"] = run_case(column(sequence_parallel=True), x_seq, tp)
    row_layer = row(skip_bias_add=False)
    cases["row"] = {**run_case(row_layer, x_hidden, tp), "master": master(row_layer), "full_bias": FULL_BIAS.tolist()}
    cases["row_sp"] = run_case(row(skip_bias_add=False, sequence_parallel=True), x_hidden, tp)
    # biases returned to the caller
    cases["column_skip_bias_add"] = run_case(column(skip_bias_add=True), X, tp)
    cases["row_skip_bias_add"] = run_case(row(skip_bias_add=True), x_hidden, tp)
    return cases


def cpu_initialization(seed: int = 5) -> dict:
    """One master weight on every rank, strided pieces rank::world kept; the master comes from the CPU RNG as
    the caller seeded it."""
    torch.manual_seed(seed)
    strided = layers.ColumnParallelLinear(
        IN,
        OUT,
        config=config(),
        init_method=init_method,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        stride=2,
        keep_master_weight_for_test=True,
        bias=False,
    )
    return {
        "stride": 2,
        "master": strided.master_weight.tolist(),
        "weight": strided.weight.tolist(),
        "storage_bytes": strided.weight.untyped_storage().nbytes(),
        "tensor_model_parallel": strided.weight.tensor_model_parallel,
        "partition_stride": strided.weight.partition_stride,
        "partition_dim": strided.weight.partition_dim,
    }


def fusion_without_apex() -> str | None:
    """gradient_accumulation_fusion: without APEX's fused_weight_gradient_mlp_cuda the layer refuses to build."""
    try:
        layers.ColumnParallelLinear(
            IN,
            OUT,
            config=config(gradient_accumulation_fusion=True),
            init_method=init_method,
            tp_group=parallel_state.get_tensor_model_parallel_group(),
        )
    except RuntimeError as error:
        return str(error)
    return None


class KernelStandIn:
    """Stands in for APEX's CUDA module: records which entry point megatron calls with which buffers, and
    accumulates what a kernel of that signature can only compute given the shapes: main_grad += dY^T X."""

    def __init__(self):
        self.calls = []

    def _accumulate(self, variant, total_input, grad_output, main_grad):
        self.calls.append(
            {
                "variant": variant,
                "total_input": list(total_input.shape),
                "grad_output": list(grad_output.shape),
                "main_grad": list(main_grad.shape),
                "main_grad_dtype": str(main_grad.dtype),
            }
        )
        main_grad.add_((grad_output.t() @ total_input).to(main_grad.dtype))

    def wgrad_gemm_accum_fp32(self, total_input, grad_output, main_grad):
        self._accumulate("fp32", total_input, grad_output, main_grad)

    def wgrad_gemm_accum_fp16(self, total_input, grad_output, main_grad):
        self._accumulate("fp16", total_input, grad_output, main_grad)


def fusion_case(main_grad_dtype, fsdp=False, ddp=False, two_micro_batches=True):
    """gradient_accumulation_fusion=True on a weight carrying main_grad (as megatron's DDP or Megatron-FSDP
    gives it; `ddp` also sets the flag megatron's DDP sets); returns what reached the kernel, main_grad,
    .grad and what plain autograd computes."""
    kernel = KernelStandIn()
    layers._grad_accum_fusion_available, layers.fused_weight_gradient_mlp_cuda = True, kernel
    torch.manual_seed(6)
    layer = layers.ColumnParallelLinear(
        IN,
        OUT,
        config=config(gradient_accumulation_fusion=True),
        init_method=init_method,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        bias=False,
    )
    weight = layer.weight
    weight.main_grad = torch.zeros(weight.shape, dtype=main_grad_dtype)
    if ddp:
        weight.grad_added_to_main_grad = False
    if fsdp:  # Megatron-FSDP's parameter: main_grad comes from its buffer
        buffer = torch.zeros(weight.shape, dtype=main_grad_dtype)
        weight.__fsdp_param__ = True
        weight.get_main_grad = lambda: buffer
    expected = torch.zeros(weight.shape)
    for micro_batch in range(2 if two_micro_batches else 1):
        x = torch.randn(S, B, IN, generator=torch.Generator().manual_seed(10 + micro_batch))
        layer(x)[0].sum().backward()
        with torch.no_grad():
            expected += torch.ones(S * B, OUT // dist.get_world_size()).t() @ x.reshape(S * B, IN)
    del layers.fused_weight_gradient_mlp_cuda
    layers._grad_accum_fusion_available = False
    return {
        "calls": kernel.calls,
        "main_grad": weight.main_grad.float().tolist(),
        "grad_is_none": weight.grad is None,
        "grad_shape": None if weight.grad is None else list(weight.grad.shape),
        "grad_added_to_main_grad": getattr(weight, "grad_added_to_main_grad", None),
        "expected_main_grad": expected.tolist(),
    }


def block_ring_bytes(sequence_parallel: bool) -> float:
    """Bytes one rank sends by ring for a transformer block's four TP layers at hidden size IN, in the order a
    block runs them: column h -> 3h (QKV), row h -> h (projection), column h -> 4h (fc1), row 4h -> h (fc2)."""
    tp = parallel_state.get_tensor_model_parallel_group()
    world, rank = dist.get_world_size(), dist.get_rank()
    h, total = IN, 0.0
    for kind, size_in, size_out in [("column", h, 3 * h), ("row", h, h), ("column", h, 4 * h), ("row", 4 * h, h)]:
        cfg = config(sequence_parallel=sequence_parallel)
        torch.manual_seed(7)
        if kind == "column":
            layer = layers.ColumnParallelLinear(size_in, size_out, config=cfg, init_method=init_method, tp_group=tp)
            x = torch.randn(S, B, size_in).chunk(world, dim=0)[rank] if sequence_parallel else torch.randn(S, B, h)
        else:
            layer = layers.RowParallelLinear(
                size_in,
                size_out,
                config=cfg,
                init_method=init_method,
                tp_group=tp,
                bias=True,
                input_is_parallel=True,
                skip_bias_add=False,
            )
            x = torch.randn(S, B, size_in).chunk(world, dim=-1)[rank]
        total += ring_bytes(run_case(layer, x, tp))
    return total


@functools.cache
def records() -> list[dict]:
    """Every case megatron ran, on every rank (computed once a rank, then gathered): CPU only, its CUDA calls
    redirected there."""
    cuda_calls_on_cpu()
    with megatron_parallel_state(tensor_model_parallel_size=WORLD):
        mine = {
            **layer_cases(),
            "init": cpu_initialization(),
            "init_seeded_by_rank": cpu_initialization(seed=5 + dist.get_rank())["master"],
            "fusion_without_apex": fusion_without_apex(),
            "fusion_fp32": fusion_case(torch.float32),
            "fusion_bf16": fusion_case(torch.bfloat16),
            "fusion_ddp": fusion_case(torch.float32, ddp=True, two_micro_batches=False),
            "fusion_megatron_fsdp": fusion_case(torch.float32, fsdp=True, two_micro_batches=False),
            "block_bytes": {sp: block_ring_bytes(sp) for sp in (False, True)},
        }
    return every_rank(mine)


def cases(name: str) -> list[dict]:
    return [r[name] for r in records()]


def ops(case: dict, phase: str) -> list[tuple]:
    """(op, output shape) of the GEMMs, additions and collectives of one phase, in issue order."""
    return [(o["op"], o["shape"]) for o in case["ops"] if o["phase"] == phase]


def collectives(case: dict, phase: str | None = None) -> list[tuple]:
    return [(e["op"], e["nbytes"], e["async_op"]) for e in case["events"] if phase in (None, e["phase"])]


def tensor(values) -> torch.Tensor:
    return torch.tensor(values)


@on_ranks(WORLD)
def test_column_defaults_allreduce_dx_async_between_dx_and_dw_gemms(ranks):
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


@on_ranks(WORLD)
def test_async_tensor_model_parallel_allreduce_is_ignored(ranks):
    """The old config flag changes nothing: dX's all-reduce is still issued asynchronously in the kernel."""
    for plain, flag_off in zip(cases("column"), cases("column_async_flag_off")):
        assert flag_off["allreduce_dgrad"] is True
        assert collectives(flag_off) == collectives(plain) == [("all_reduce", ACTIVATION_BYTES, True)]
        assert ops(flag_off, "backward") == ops(plain, "backward")


@on_ranks(WORLD)
def test_column_input_enters_the_kernel_unwrapped_f_only_at_tp1(ranks):
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


@on_ranks(WORLD)
def test_disable_grad_reduce_and_expert_layers_leave_dx_unreduced(ranks):
    """disable_grad_reduce clears allreduce_dgrad; an expert layer keeps the attribute but its forward passes
    False: either way no collective runs and each rank keeps its partial dX."""
    disabled, expert = cases("column_disable_grad_reduce"), cases("column_expert")
    assert [c["allreduce_dgrad"] for c in disabled] == [False] * WORLD
    assert [c["allreduce_dgrad"] for c in expert] == [True] * WORLD
    for case in disabled + expert:
        assert collectives(case) == [] and not case["dx_equal_across_ranks"]
    partial_sum = sum(tensor(c["dx"]) for c in disabled)
    torch.testing.assert_close(partial_sum, tensor(cases("column")[0]["dx"]))


@on_ranks(WORLD)
def test_sequence_parallel_gathers_input_in_forward_and_again_in_backward_then_reduce_scatters_dx(ranks):
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


@on_ranks(WORLD)
def test_row_sequence_parallel_reduce_scatters_what_it_would_all_reduce(ranks):
    """The row layer's forward all-reduce becomes a reduce-scatter of the same tensor; backward all-gathers dY."""
    for plain, sp in zip(cases("row"), cases("row_sp")):
        row_bytes = S * B * OUT * 4
        assert collectives(plain) == [("all_reduce", row_bytes, False)]
        assert collectives(sp, "forward") == [("reduce_scatter", row_bytes, False)]
        assert collectives(sp, "backward") == [("all_gather", row_bytes, False)]


def ring_bytes(case: dict) -> float:
    """Bytes one rank sends for a case's collectives by ring algorithms: (N-1)/N of the whole tensor for an
    all-gather or a reduce-scatter, twice that for an all-reduce."""
    sends = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}
    return sum(sends[op] * nbytes for op, nbytes, _ in collectives(case)) * (WORLD - 1) / WORLD


@on_ranks(WORLD)
def test_sequence_parallel_adds_one_all_gather_per_column_layer_a_quarter_more_tp_bytes_per_block(ranks):
    """Each replaced all-reduce costs the same (the row layer); the column layer's backward re-gather of its
    input is one all-gather more. Summed over a real block's four layers (QKV, projection, fc1, fc2), whose
    collectives all carry [s, b, h]: 3 + 2 + 3 + 2 units under sequence parallelism against 2 + 2 + 2 + 2."""
    for record in records():
        assert ring_bytes(record["row_sp"]) == ring_bytes(record["row"])
        extra = ring_bytes(record["column_sp"]) - ring_bytes(record["column"])
        assert extra == ACTIVATION_BYTES * (WORLD - 1) / WORLD  # one all-gather of the column layer's input
        block = record["block_bytes"]
        assert block[False] == 8 * ACTIVATION_BYTES * (WORLD - 1) / WORLD
        assert block[True] / block[False] == 1.25


def column_expected(rank: int, with_bias: bool) -> torch.Tensor:
    case = cases("column")[rank]
    shard = tensor(case["master"]).chunk(WORLD, 0)[rank]
    bias = tensor(case["full_bias"]).chunk(WORLD)[rank]
    return X @ shard.t() + (bias if with_bias else 0)


@on_ranks(WORLD)
def test_column_bias_is_sharded_and_added_after_the_matmul(ranks):
    for rank, case in enumerate(cases("column")):
        assert case["bias_shape"] == [OUT // WORLD]
        assert ops(case, "forward") == [("aten::mm", [S * B, OUT // WORLD]), ("aten::add", [S, B, OUT // WORLD])]
        torch.testing.assert_close(tensor(case["output"]), column_expected(rank, with_bias=True))


def row_expected(with_bias: bool) -> torch.Tensor:
    case = cases("row")[0]
    return X @ tensor(case["master"]).t() + (tensor(case["full_bias"]) if with_bias else 0)


@on_ranks(WORLD)
def test_row_bias_is_replicated_and_added_once_after_the_allreduce(ranks):
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


@on_ranks(WORLD)
def test_row_allreduce_is_an_autograd_function_all_reduce_forward_identity_backward(ranks):
    """The row layer's output passes _ReduceFromModelParallelRegion: all-reduced in forward, its gradient passed
    through untouched, so the row backward issues no collective and each rank's dX is its slice of the full dX."""
    full_dx = torch.ones(S, B, OUT) @ tensor(cases("row")[0]["master"])
    for rank, case in enumerate(cases("row")):
        assert case["chain"][:2] == ["AddBackward0", "_ReduceFromModelParallelRegionBackward"]
        assert collectives(case, "forward") == [("all_reduce", S * B * OUT * 4, False)]
        assert collectives(case, "backward") == []
        torch.testing.assert_close(tensor(case["dx"]), full_dx.chunk(WORLD, dim=-1)[rank])


@on_ranks(WORLD)
def test_skip_bias_add_returns_the_bias_unadded_column_and_row(ranks):
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


@on_ranks(WORLD)
def test_cpu_initialization_builds_the_master_weight_and_keeps_strided_pieces(ranks):
    """Every rank seeded alike draws the same full [out, in] master (seeded by rank, they differ); with
    stride 2 it splits it into pieces of out / p / 2 rows and keeps pieces rank, rank + p, ...: not the
    contiguous chunk. The shard is a tagged Parameter with storage of its own."""
    inits = [r["init"] for r in records()]
    masters = [tensor(i["master"]) for i in inits]
    assert masters[0].shape == (OUT, IN) and all(torch.equal(m, masters[0]) for m in masters)
    # the same master only because every rank seeded its CPU RNG alike: megatron-core does not seed it
    unlike = [tensor(r["init_seeded_by_rank"]) for r in records()]
    assert not torch.equal(unlike[0], unlike[1])
    pieces = masters[0].split(OUT // WORLD // 2, dim=0)
    for rank, init in enumerate(inits):
        assert (init["tensor_model_parallel"], init["partition_dim"], init["partition_stride"]) == (True, 0, 2)
        assert init["storage_bytes"] == OUT // WORLD * IN * 4, "its own [out/p, in] storage, not a view of the master"
        weight = tensor(init["weight"])
        assert torch.equal(weight, torch.cat(pieces[rank::WORLD]))
        assert not torch.equal(weight, masters[0].chunk(WORLD)[rank])


@on_ranks(WORLD)
def test_gradient_accumulation_fusion_requires_the_apex_cuda_kernel(ranks):
    for record in records():
        assert "fused_weight_gradient_mlp_cuda" in record["fusion_without_apex"]
        assert "APEX" in record["fusion_without_apex"]


@on_ranks(WORLD)
def test_gradient_accumulation_fusion_hands_the_kernel_dy_x_and_main_grad_by_dtype(ranks):
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


@on_ranks(WORLD)
def test_gradient_accumulation_fusion_gives_autograd_a_placeholder_under_megatron_ddp(ranks):
    """A weight carrying megatron DDP's grad_added_to_main_grad gets a placeholder .grad of the weight's shape
    (so DDP's hooks still fire) and the flag set, telling the hook not to add it to main_grad again."""
    for record in records():
        case = record["fusion_ddp"]
        assert case["grad_shape"] == [OUT // WORLD, IN] and case["grad_added_to_main_grad"] is True
        torch.testing.assert_close(tensor(case["main_grad"]), tensor(case["expected_main_grad"]))


@on_ranks(WORLD)
def test_megatron_fsdp_weight_takes_a_plain_matmul_not_the_apex_kernel(ranks):
    for record in records():
        case = record["fusion_megatron_fsdp"]
        assert case["calls"] == [] and case["grad_is_none"]
        torch.testing.assert_close(tensor(case["main_grad"]), tensor(case["expected_main_grad"]))
