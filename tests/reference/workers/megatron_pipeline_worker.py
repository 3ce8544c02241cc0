"""megatron-core 0.16.1's own 1F1B schedule on CPU/gloo: what each stage runs, and when, under each setting.

Usage: megatron_pipeline_worker.py OUT_DIR (4 ranks). Each rank writes OUT_DIR/rank<r>.json: per run, the ordered
event log of one `forward_backward_pipelining_without_interleaving` call, obtained from
`get_forward_backward_func()` after `parallel_state.initialize_model_parallel(pipeline_model_parallel_size=p)`.
Events: F<i>/B<i> (forward_step_func and schedules.backward_step), the config hooks (no_sync enter/exit,
grad_sync, finalize), every DP all-reduce, every p2p call (batched or not) and the autograd marker between a
stage's two layers; each ends with perf_counter(), one clock for all ranks. Also: the action order of the
interleaved schedule (2 model chunks per stage), of the reference's 1F1B on the same group, and the gradient
dtype of megatron's DDP around a bf16 stage. Interleaved (forward_backward_pipelining_with_interleaving):
the action order at v 2 and 3, m 4 and 8, next to the reference's interleaved 1F1B, and its refusal of m 6 at
p 4. test_megatron_pipeline_upstream.py and test_interleaved.py assert on them.

Runs on CPU because megatron allocates on torch.cuda.current_device() (redirected to "cpu"), creates its token
counter with device="cuda" (a TorchFunctionMode sends it to the CPU) and calls torch.cuda.synchronize() after
every batched p2p round (batch_p2p_sync; a no-op here).
"""

import contextlib
import functools
import time

import torch
import torch.distributed as dist
from common import serve
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron_state import megatron_parallel_state
from torch.overrides import TorchFunctionMode

from reference.measure.pipeline_meter import PipelineMeter
from reference.pipeline.schedules import forward_backward as reference_forward_backward
from reference.torch_patches import cuda_calls_on_cpu

S, B, H = 4, 2, 8  # what goes between stages: (seq, micro-batch, hidden), megatron's tensor_shapes
EVENTS: list = []  # the current run's log: [name, details..., perf_counter()] (one clock for all ranks)
BACKWARD_SLEEP = {"s": 0.0}  # makes each backward last long enough to order events across ranks by time


def log(*fields):
    EVENTS.append([*fields, time.perf_counter()])


class CudaLiteralToCpu(TorchFunctionMode):
    """torch.zeros(..., device="cuda") in the schedule (its token counter) lands on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class Marker(torch.autograd.Function):
    """Identity whose backward logs `name`: the backward has reached this point of the stage."""

    @staticmethod
    def forward(ctx, x, name):
        ctx.name = name
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        log(ctx.name)
        time.sleep(BACKWARD_SLEEP["s"])
        return grad, None


class Stage(MegatronModule):
    """Two Linear+tanh layers; the first stage reads the micro-batch, the others the received activation."""

    def __init__(self, config: TransformerConfig, first: bool, last: bool):
        super().__init__(config)
        self.model_type = ModelType.encoder_or_decoder
        # what finalize_model_grads asks of a stage (no embedding shared between the first and last stages)
        self.pre_process, self.post_process, self.share_embeddings_and_output_weights = first, last, False
        self.first, self.input_tensor = first, None
        torch.manual_seed(100 + parallel_state.get_pipeline_model_parallel_rank())
        self.layers = torch.nn.ModuleList([torch.nn.Linear(H, H) for _ in range(2)])

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0] if isinstance(tensors, list) else tensors

    def forward(self, x):
        h = x if self.first else self.input_tensor
        h = torch.tanh(self.layers[0](h))
        h = Marker.apply(h, "bwd_layer1_done")  # its backward runs after layer 1's backward, before layer 0's
        return torch.tanh(self.layers[1](h))


def micro_batches(m: int):
    g = torch.Generator().manual_seed(7)
    return [{"mb": i, "x": torch.randn(S, B, H, generator=g), "y": torch.randn(S, B, H, generator=g)} for i in range(m)]


def loss_function(kind: str, mb: int, target, output):
    """The three forms megatron accepts: (loss, reported) or (loss, num_tokens, reported)."""
    per_token = ((output - target) ** 2).mean(dim=-1)
    if kind == "two":
        loss = per_token.mean()
        loss.microbatch = mb
        log("loss", mb, loss.item())
        return loss, {"loss": loss.detach().clone()}
    loss, tokens = per_token.sum(), torch.tensor(per_token.numel(), dtype=torch.int)
    loss.microbatch = mb
    log("loss", mb, loss.item(), int(tokens))
    return loss, tokens, {"loss": loss.detach().clone()}


def forward_step_func(loss_kind, data_iterator, model):
    batch = next(data_iterator)
    chunk = getattr(model, "vp_stage", None)
    mb = batch["mb"] if chunk is None else f"{chunk}.{batch['mb']}"  # interleaved: F<chunk>.<micro-batch>
    log(f"F{mb}")
    output = model(batch["x"])
    output.microbatch = mb
    return output, functools.partial(loss_function, loss_kind, mb, batch["y"])


def run_schedule(forward_backward, model, m: int, loss: str = "two") -> None:
    """One call of a megatron schedule over m micro-batches of `loss` (one data iterator per model chunk when
    `model` is a list of chunks), with the schedule's CUDA tensors sent to the CPU."""
    data = [iter(micro_batches(m)) for _ in model] if isinstance(model, list) else iter(micro_batches(m))
    with CudaLiteralToCpu():
        forward_backward(
            forward_step_func=functools.partial(forward_step_func, loss),
            data_iterator=data,
            model=model,
            num_microbatches=m,
            seq_length=S,
            micro_batch_size=B,
        )


def logged_backward_step(original):
    """schedules.backward_step, logging which micro-batch it runs, what it starts from and its output's size."""

    def backward_step(input_tensor, output_tensor, output_tensor_grad, model_type, config):
        out = output_tensor[0] if isinstance(output_tensor, list) else output_tensor
        grad = output_tensor_grad[0] if isinstance(output_tensor_grad, list) else output_tensor_grad
        mb = getattr(out, "microbatch", None)
        log(f"B{mb}", out.numel(), out.item() if grad is None else None)
        result = original(input_tensor, output_tensor, output_tensor_grad, model_type, config)
        log(f"B{mb}_end")
        return result

    return backward_step


def logged(fn, name):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if name == "all_reduce":
            group = kwargs.get("group")
            log(
                "all_reduce",
                dist.get_process_group_ranks(group) if group else None,
                args[0].numel(),
                bool(kwargs.get("async_op")),
            )
        elif name == "batch_isend_irecv":
            log("batch", [[op.op.__name__, op.peer] for op in args[0]])
        else:
            log(name, kwargs.get("dst", kwargs.get("src")))
        return fn(*args, **kwargs)

    return wrapper


def logged_context(name, inner=contextlib.nullcontext):
    @contextlib.contextmanager
    def context():
        log(f"{name}_enter")
        with inner():
            yield
        log(f"{name}_exit")

    return context


def run(
    name: str,
    *,
    pp: int,
    m: int,
    loss: str = "two",
    iterations: int = 1,
    ddp: dict | None = None,
    align: bool = False,
    config_kw: dict | None = None,
    unbatched_log=False,
    backward_sleep: float = 0.0,
    first_stage_backward_sleep: float | None = None,
):
    """One megatron forward_backward call per iteration; returns the last iteration's log and the grads.

    ddp: megatron's DistributedDataParallelConfig fields (the stage is wrapped in its DDP); its hooks are then
    set as megatron/training/training.py sets them: no_sync_func only with overlap_grad_reduce, grad_sync_func
    (= start_grad_sync) only with align (its --align-grad-reduce). Without ddp, a no_sync_func that only logs.
    backward_sleep: how long each backward lasts at least (first_stage_backward_sleep on the first stage, when
    given), so that events of different ranks are ordered by their times.
    """
    with megatron_parallel_state(pipeline_model_parallel_size=pp):
        config = TransformerConfig(
            num_layers=pp,
            hidden_size=H,
            num_attention_heads=1,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,
            **(config_kw or {}),
        )
        first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        BACKWARD_SLEEP["s"] = first_stage_backward_sleep if first and first_stage_backward_sleep else backward_sleep
        model = Stage(config, first, last)
        if ddp is not None:  # megatron's own DDP, wired as megatron/training/training.py wires it
            model = DistributedDataParallel(config, DistributedDataParallelConfig(**ddp), model)
            if ddp.get("overlap_grad_reduce"):
                config.no_sync_func = logged_context("no_sync", model.no_sync)
                if align:

                    def grad_sync(params, start=model.start_grad_sync):
                        log("grad_sync_func")
                        start()

                    config.grad_sync_func = grad_sync
        else:
            config.no_sync_func = logged_context("no_sync")

        def finalize(*args, **kwargs):
            log("finalize_enter", args[1] is not None and int(args[1]))
            if ddp is not None:
                finalize_model_grads(*args, **kwargs)
            log("finalize_exit")

        config.finalize_model_grads_func = finalize
        patches = {"all_reduce": torch.distributed.all_reduce, "batch_isend_irecv": torch.distributed.batch_isend_irecv}
        if unbatched_log:  # batched P2POps need the real isend/irecv (P2POp checks its op)
            patches.update(isend=torch.distributed.isend, irecv=torch.distributed.irecv)
        forward_backward = schedules.get_forward_backward_func()
        assert forward_backward is schedules.forward_backward_pipelining_without_interleaving
        original_backward_step = schedules.backward_step
        for attr, fn in patches.items():
            setattr(torch.distributed, attr, logged(fn, attr))
        schedules.backward_step = logged_backward_step(original_backward_step)
        try:
            for _ in range(iterations):
                EVENTS.clear()
                if ddp is not None:
                    model.zero_grad_buffer()
                run_schedule(forward_backward, model, m, loss)
        finally:
            schedules.backward_step = original_backward_step
            for attr, fn in patches.items():
                setattr(torch.distributed, attr, fn)
        inner = model.module if ddp is not None else model
        grads = [(p.main_grad if ddp is not None else p.grad).flatten().tolist() for p in inner.parameters()]
        result = {
            "name": name,
            "pp": pp,
            "m": m,
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "dp_size": parallel_state.get_data_parallel_world_size(),
            "first": first,
            "last": last,
            "events": list(EVENTS),
            "grads": grads,
            "defaults": {
                k: getattr(config, k)
                for k in ("batch_p2p_comm", "batch_p2p_sync", "deallocate_pipeline_outputs", "calculate_per_token_loss")
            },
        }
        if ddp is not None:
            result["ddp_defaults"] = {k: getattr(model.ddp_config, k) for k in ("overlap_grad_reduce",)}
            result["buckets"] = len(model.bucket_groups)
    return result


def interleaved_state(p: int, v: int):
    """Megatron's parallel state for p stages of v virtual stages each (both interleaved runs below)."""
    return megatron_parallel_state(pipeline_model_parallel_size=p, virtual_pipeline_model_parallel_size=v)


def interleaved_config(p: int, v: int) -> TransformerConfig:
    """A config of one layer per virtual stage, p stages of v virtual stages each."""
    return TransformerConfig(
        num_layers=p * v,
        hidden_size=H,
        num_attention_heads=1,
        pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=v,
        pipeline_dtype=torch.float32,
    )


def interleaved_actions(p: int, v: int, m: int) -> list[str]:
    """This stage's order under forward_backward_pipelining_with_interleaving: v model chunks per stage (chunk c
    of stage r is virtual stage c * p + r), picked by get_forward_backward_func from parallel_state."""
    with interleaved_state(p, v):
        config = interleaved_config(p, v)
        r = parallel_state.get_pipeline_model_parallel_rank()
        chunks = []
        for c in range(v):
            chunk = Stage(config, first=r == 0 and c == 0, last=r == p - 1 and c == v - 1)
            chunk.vp_stage = c
            chunks.append(chunk)
        forward_backward = schedules.get_forward_backward_func()
        assert forward_backward is schedules.forward_backward_pipelining_with_interleaving
        original_backward_step = schedules.backward_step
        schedules.backward_step = logged_backward_step(original_backward_step)
        EVENTS.clear()
        try:
            run_schedule(forward_backward, chunks, m)
        finally:
            schedules.backward_step = original_backward_step
    return [e[0] for e in EVENTS if e[0][0] in "FB" and not e[0].endswith("_end")]


def interleaved_refusal(p: int, v: int, m: int) -> str:
    """What forward_backward_pipelining_with_interleaving says when m is not a multiple of p (its default
    microbatch_group_size_per_vp_stage); it checks before any communication."""
    with interleaved_state(p, v):
        config = interleaved_config(p, v)
        chunks = [Stage(config, first=False, last=False) for _ in range(v)]
        try:
            run_schedule(schedules.forward_backward_pipelining_with_interleaving, chunks, m)
        except (RuntimeError, ValueError) as error:
            return f"{type(error).__name__}: {error}"
    return "accepted"


def reference_actions(p: int, m: int, v: int = 1) -> list[str]:
    """The reference's 1F1B (reference.pipeline.schedules) on the same PP group: its action order; with v > 1
    model chunks per stage, its interleaved 1F1B."""
    with megatron_parallel_state(pipeline_model_parallel_size=p):
        group, r = parallel_state.get_pipeline_model_parallel_group(), parallel_state.get_pipeline_model_parallel_rank()

        def chunk(c: int):
            layer = torch.nn.Linear(H, H)

            def stage(x, hidden=None):
                out = layer(x if r == 0 and c == 0 else hidden)
                return out.pow(2).mean() if r == p - 1 and c == v - 1 else out

            return stage

        batches = [(mb["x"],) for mb in micro_batches(m)]
        stage = chunk(0) if v == 1 else [chunk(c) for c in range(v)]
        meter = PipelineMeter()
        reference_forward_backward("1f1b", stage, batches, pp_group=group, activation_shape=(S, B, H), observer=meter)
    return meter.actions


def deallocated_output_rejects_plain_backward() -> str:
    """What torch.autograd.backward says about an output whose .data deallocate_output_tensor shrank."""
    out = torch.tanh(torch.nn.Linear(H, H)(torch.randn(S, B, H)))
    schedules.deallocate_output_tensor(out, deallocate_pipeline_outputs=True)
    try:
        torch.autograd.backward(out, grad_tensors=torch.ones(S, B, H))
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "accepted"


def ddp_grad_dtypes() -> dict[str, str]:
    """The gradient buffer dtype of megatron's DDP around a bf16 stage, by default and with grad_reduce_in_fp32."""
    dtypes = {}
    with megatron_parallel_state(pipeline_model_parallel_size=2):
        for name, ddp in [("default", {}), ("grad_reduce_in_fp32", {"grad_reduce_in_fp32": True})]:
            config = TransformerConfig(
                num_layers=2,
                hidden_size=H,
                num_attention_heads=1,
                pipeline_model_parallel_size=2,
                pipeline_dtype=torch.bfloat16,
                params_dtype=torch.bfloat16,
                bf16=True,
            )
            stage = Stage(config, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
            model = DistributedDataParallel(config, DistributedDataParallelConfig(**ddp), stage.to(torch.bfloat16))
            dtypes[name] = str(model.buffers[0].grad_dtype)
    return dtypes


def results(device: torch.device) -> dict:
    """Every run's event log on this rank, and the schedules' action orders."""
    assert device.type == "cpu" and dist.get_world_size() == 4, "run on 4 CPU ranks"
    cuda_calls_on_cpu()
    runs = [
        run("defaults_m6", pp=4, m=6),
        run("defaults_m2", pp=4, m=2),
        run("unbatched_m6", pp=4, m=6, config_kw={"batch_p2p_comm": False}, unbatched_log=True),
        run("deallocate_m6", pp=4, m=6, config_kw={"deallocate_pipeline_outputs": True}),
        run("three_output_m6", pp=4, m=6, loss="three"),
        # megatron's DDP and finalize_model_grads, so that the per-token division of the gradients happens
        run("per_token_m6", pp=4, m=6, loss="three", config_kw={"calculate_per_token_loss": True}, ddp={}),
        # pp 2 x dp 2; a bucket per layer where megatron buckets at all (the first stage); the second iteration
        # is the one logged (in the first, megatron's overlapping DDP learns which grads fill each bucket)
        run("ddp_defaults", pp=2, m=4, iterations=2, ddp={}, backward_sleep=0.05),
        run(
            "ddp_overlap",
            pp=2,
            m=4,
            iterations=2,
            ddp={"overlap_grad_reduce": True, "bucket_size": H * H + H},
            backward_sleep=0.05,
        ),
        run(
            "ddp_overlap_align",
            pp=2,
            m=4,
            iterations=2,
            align=True,
            ddp={"overlap_grad_reduce": True, "bucket_size": H * H + H},
            backward_sleep=0.05,
            # the later stage's all-reduce must be seen inside the first stage's drain even on a loaded
            # machine (CI once ran this stage more than 50 ms late after it sent its last gradient)
            first_stage_backward_sleep=0.5,
        ),
    ]
    result = {
        "runs": {r["name"]: r for r in runs},
        "reference_actions": {"m6": reference_actions(4, 6), "m2": reference_actions(4, 2)},
        "deallocated_plain_backward": deallocated_output_rejects_plain_backward(),
        "bf16_grad_dtypes": ddp_grad_dtypes(),
        "interleaved_v2_m8": interleaved_actions(4, 2, 8),
        "interleaved_v2_m4": interleaved_actions(4, 2, 4),
        "interleaved_v3_m4": interleaved_actions(4, 3, 4),
        "reference_interleaved": {f"v{v}_m{m}": reference_actions(4, m, v) for v, m in ((2, 8), (2, 4), (3, 4))},
        "interleaved_m6_refused": interleaved_refusal(4, 2, 6),
        "defaults_m8": [
            e[0] for e in run("defaults_m8", pp=4, m=8)["events"] if e[0][0] in "FB" and not e[0].endswith("_end")
        ],
        "with_virtual_stages": schedules.get_forward_backward_func(pp_size=4, vp_size=2).__name__,
    }
    return result


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()
