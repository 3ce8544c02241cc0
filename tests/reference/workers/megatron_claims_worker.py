"""Run megatron-core 0.16.1's ColumnParallelLinear / RowParallelLinear in the configurations the TP note
describes and dump, per case, what they did: collectives (CollectiveRecorder), GEMMs and bias additions in
issue order, the autograd nodes between output and input, the shapes autograd saved, and the numbers.

Usage: megatron_claims_worker.py OUT_DIR (world 2, CPU/gloo). Writes OUT_DIR/rank<r>.json, read by
tests/reference/test_megatron_upstream_claims.py. megatron runs with use_cpu_initialization=True (its GPU
path needs CUDA); its buffers allocated on torch.cuda.current_device() are redirected to the CPU.
"""

import time

import torch
import torch.distributed as dist
from common import serve
from megatron.core import parallel_state as mpu
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import layers
from megatron_state import megatron_parallel_state
from torch.utils._python_dispatch import TorchDispatchMode

from reference.measure.recorder import CollectiveRecorder, current_phase
from reference.torch_patches import cuda_calls_on_cpu

IN, OUT, S, B = 12, 20, 4, 3  # GEMM outputs differ in shape: dX [S*B, IN], dW [OUT/p, IN] or [OUT, IN/p]
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
    group = group or mpu.get_tensor_model_parallel_group()
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
    tp = mpu.get_tensor_model_parallel_group()
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
    tp = mpu.get_tensor_model_parallel_group()
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


def cpu_initialization() -> dict:
    """One master weight on every rank, strided pieces rank::world kept."""
    torch.manual_seed(5)
    strided = layers.ColumnParallelLinear(
        IN,
        OUT,
        config=config(),
        init_method=init_method,
        tp_group=mpu.get_tensor_model_parallel_group(),
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
            tp_group=mpu.get_tensor_model_parallel_group(),
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
        tp_group=mpu.get_tensor_model_parallel_group(),
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


def results(device: torch.device) -> dict:
    """Every case megatron ran on this rank (CPU only: its buffers are redirected there)."""
    assert device.type == "cpu", "megatron runs here with CPU initialization and CUDA calls redirected to the CPU"
    cuda_calls_on_cpu()
    with megatron_parallel_state(tensor_model_parallel_size=dist.get_world_size()):
        return {
            **layer_cases(),
            "init": cpu_initialization(),
            "fusion_without_apex": fusion_without_apex(),
            "fusion_fp32": fusion_case(torch.float32),
            "fusion_bf16": fusion_case(torch.bfloat16),
            "fusion_ddp": fusion_case(torch.float32, ddp=True, two_micro_batches=False),
            "fusion_megatron_fsdp": fusion_case(torch.float32, fsdp=True, two_micro_batches=False),
        }


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()
