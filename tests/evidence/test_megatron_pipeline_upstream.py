"""The close reading of Megatron-LM's 1F1B schedule, checked on megatron-core 0.16.1 itself (CPU/gloo, 4 ranks).

Every rank of a 4-rank launch runs (`logs()`, once a rank) `forward_backward_pipelining_without_interleaving` (picked
by `get_forward_backward_func`) at pp 4 and at pp 2 x dp 2 with megatron's own DistributedDataParallel, and logs
per rank the forwards, backwards, p2p calls, config hooks and DP all-reduces, in order and on one clock.
What CPU/gloo cannot show: that a batch_isend_irecv is one NCCL group (gloo runs its ops one by one), the
torch.cuda.synchronize() of batch_p2p_sync (a no-op here), and CUDA-stream concurrency: an all-reduce
"overlapping" a backward is shown by when it is issued, not by kernels running side by side.
"""

from __future__ import annotations

import contextlib
import functools
import time

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.enums import ModelType
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.overrides import TorchFunctionMode

from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.replay import idle_fraction
from reference.measure.torch_patches import cuda_calls_on_cpu
from reference.pipeline.schedules import forward_backward as reference_forward_backward
from tests.ranks import on_ranks
from tests.reference.helpers import every_rank, megatron_parallel_state

pytestmark = pytest.mark.upstream("megatron-lm")


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


def buckets_of_a_two_dtype_stage() -> dict[str, int]:
    """Megatron's DDP around a stage with one bf16 and one fp32 layer, a bucket per layer asked for: its gradient
    buffers (one per dtype) and bucket groups, on this rank's stage of pp 2."""
    with megatron_parallel_state(pipeline_model_parallel_size=2):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=H,
            num_attention_heads=1,
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
        )
        stage = Stage(config, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
        stage.layers[0].to(torch.bfloat16)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(bucket_size=H * H + H), stage)
        return {"buffers": len(model.buffers), "buckets": len(model.bucket_groups)}


def buckets_without_overlap() -> int:
    """Megatron's DDP with overlap_grad_reduce left off, a bucket per layer asked for: its bucket groups on this
    rank's stage of pp 2 (the first stage's too, which with overlap on takes the asked size)."""
    with megatron_parallel_state(pipeline_model_parallel_size=2):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=H,
            num_attention_heads=1,
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
        )
        stage = Stage(config, parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())
        model = DistributedDataParallel(config, DistributedDataParallelConfig(bucket_size=H * H + H), stage)
        return len(model.bucket_groups)


@functools.cache
def logs() -> list[dict]:
    """Every run's event log and the schedules' action orders, on every rank (computed once a rank)."""
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
        "two_dtype_buckets": buckets_of_a_two_dtype_stage(),
        "buckets_without_overlap": buckets_without_overlap(),
        "interleaved_v2_m8": interleaved_actions(4, 2, 8),
        "interleaved_v2_m4": interleaved_actions(4, 2, 4),
        "interleaved_v3_m4": interleaved_actions(4, 3, 4),
        "reference_interleaved": {f"v{v}_m{m}": reference_actions(4, m, v) for v, m in ((2, 8), (2, 4), (3, 4))},
        "interleaved_m6_refused": interleaved_refusal(4, 2, 6),
        "interleaved_m2_refused": interleaved_refusal(4, 2, 2),
        "defaults_m8": [
            e[0] for e in run("defaults_m8", pp=4, m=8)["events"] if e[0][0] in "FB" and not e[0].endswith("_end")
        ],
        "with_virtual_stages": schedules.get_forward_backward_func(pp_size=4, vp_size=2).__name__,
    }
    return every_rank(result)


def runs(name: str) -> list[dict]:
    """The run `name` on every rank, in pipeline-rank order (ties: global rank)."""
    return sorted((r["runs"][name] for r in logs()), key=lambda run: run["pp_rank"])


def names(run: dict) -> list[str]:
    return [event[0] for event in run["events"]]


def actions(run: dict) -> list[str]:
    """F<i>/B<i> in the order the stage ran them."""
    return [n for n in names(run) if n[0] in "FB" and not n.endswith("_end")]


def backward_indices(run: dict) -> list[int]:
    return [i for i, n in enumerate(names(run)) if n[0] == "B" and not n.endswith("_end")]


@on_ranks(4)
@pytest.mark.parametrize("name", ["defaults_m6", "defaults_m2"])
def test_stage_r_runs_min_p_minus_r_minus_1_warmup_forwards_then_alternates(ranks, name):
    """Warm-up forwards are the ones followed by a send alone (send_forward); steady-state forwards are followed
    by send_forward_recv_backward. Stage r then holds at most min(p - r, m) micro-batches."""
    for run in runs(name):
        p, m, r = run["pp"], run["m"], run["pp_rank"]
        warmup = min(p - r - 1, m)
        order = actions(run)
        assert order[:warmup] == [f"F{i}" for i in range(warmup)], order
        if not run["last"]:
            events = run["events"]
            sends_alone = [
                e[0]
                for i, e in enumerate(events[1:], 1)
                if events[i - 1][0][0] == "F" and e[0] == "batch" and e[1] == [["isend", r + 1]]
            ]
            assert len(sends_alone) == warmup, (r, events)
        steady = order[warmup : warmup + 2 * (m - warmup)]
        assert steady == [a for i in range(m - warmup) for a in (f"F{warmup + i}", f"B{i}")], order
        assert order[warmup + 2 * (m - warmup) :] == [f"B{i}" for i in range(m - warmup, m)], order
        held = [sum(a[0] == "F" for a in order[:k]) - sum(a[0] == "B" for a in order[:k]) for k in range(len(order))]
        assert max(held) == min(p - r, m), (r, order)


@on_ranks(4)
@pytest.mark.parametrize("m", [6, 2])
def test_megatron_1f1b_order_is_the_reference_schedule_and_idles_p_minus_1_over_m_plus_p_minus_1(ranks, m):
    orders = [actions(run) for run in runs(f"defaults_m{m}")]
    by_pp_rank = sorted(logs(), key=lambda r: r["runs"]["defaults_m6"]["pp_rank"])
    assert orders == [r["reference_actions"][f"m{m}"] for r in by_pp_rank]
    p = len(orders)
    assert idle_fraction(orders) == pytest.approx((p - 1) / (m + p - 1))


@on_ranks(4)
def test_by_default_each_p2p_round_is_one_batch_isend_irecv(ranks):
    for run in runs("defaults_m6"):
        assert run["defaults"]["batch_p2p_comm"] is True and run["defaults"]["batch_p2p_sync"] is True
        events, r = run["events"], run["pp_rank"]
        rounds = [e[1] for e in events if e[0] == "batch"]
        kinds = [op for ops in rounds for op, _ in ops]  # every transfer of the step went through a batch:
        transfers = run["m"] * ((not run["last"]) + (not run["first"]))  # m outputs on, m gradients back
        assert kinds.count("isend") == kinds.count("irecv") == transfers, (r, rounds)
        pairs = [ops for ops in rounds if len(ops) == 2]
        m, warmup = run["m"], min(run["pp"] - r - 1, run["m"])
        # one send+receive pair per steady-state forward (to the next stage) and backward (to the previous),
        # except at the ends of the pipeline and after the last steady-state backward
        expected = (0 if run["last"] else m - warmup) + (0 if run["first"] else m - warmup - 1)
        assert len(pairs) == expected, (r, rounds)
        for ops in pairs:
            assert [op for op, _ in ops] == ["isend", "irecv"] and ops[0][1] == ops[1][1], ops


@on_ranks(4)
def test_unbatched_rounds_send_to_next_before_receiving_and_receive_from_previous_before_sending(ranks):
    """batch_p2p_comm=False: _p2p_ops' even/odd branches give 1F1B's rounds the same order on every stage."""
    for run in runs("unbatched_m6"):
        assert "batch" not in names(run)
        r, events = run["pp_rank"], [(e[0], e[1]) for e in run["events"]]
        rounds = [
            pair
            for pair in zip(events, events[1:])
            if {pair[0][0], pair[1][0]} == {"isend", "irecv"} and pair[0][1] == pair[1][1]
        ]  # a send and a receive with one peer, back to back
        assert rounds, events
        for first, second in rounds:
            peer = first[1]
            assert (first[0], second[0]) == (("isend", "irecv") if peer == r + 1 else ("irecv", "isend")), (r, rounds)
        assert {first[1] for first, _ in rounds} == {r - 1, r + 1} - {-1, run["pp"]}


@on_ranks(4)
@pytest.mark.parametrize("name", ["defaults_m6", "defaults_m2"])
def test_no_sync_is_entered_before_the_first_micro_batch_and_left_just_before_the_last_backward(ranks, name):
    for run in runs(name):
        order = names(run)
        assert order[0] == "no_sync_enter", order
        exit_at, last_backward = order.index("no_sync_exit"), backward_indices(run)[-1]
        assert [i for i in backward_indices(run) if i > exit_at] == [last_backward], order
        assert not [n for n in order[exit_at + 1 : last_backward] if n[0] == "F"], order  # nothing else runs
        before = order[:exit_at]
        assert before.count("no_sync_enter") == 1 and sum(n[0] == "F" for n in before) == run["m"], order
        assert order.index("finalize_enter") > last_backward


def dp_all_reduces(run: dict) -> list[tuple[int, list]]:
    """(position in the log, event) of every all-reduce over this rank's DP group."""
    return [(i, e) for i, e in enumerate(run["events"]) if e[0] == "all_reduce" and len(e[1]) == run["dp_size"]]


@on_ranks(4)
def test_default_megatron_ddp_reduces_once_synchronously_after_the_last_backward(ranks):
    """overlap_grad_reduce=False: backward only accumulates; finalize_model_grads issues one blocking
    all-reduce of the whole (unbucketed) gradient buffer on every stage, after all backwards. megatron-core
    installs none of the hooks itself: no_sync_func, grad_sync_func and finalize_model_grads_func default to
    None (the schedule then enters a no-op context and finalizes nothing); these runs install them as
    Megatron-LM's training does."""
    core = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1)
    assert (core.no_sync_func, core.grad_sync_func, core.finalize_model_grads_func) == (None, None, None)
    for run in runs("ddp_defaults"):
        assert run["ddp_defaults"]["overlap_grad_reduce"] is False and run["buckets"] == 1
        reduces = dp_all_reduces(run)
        assert len(reduces) == 1 and reduces[0][1][3] is False, reduces
        order = names(run)
        assert order.index("finalize_enter") < reduces[0][0] < order.index("finalize_exit")
        assert reduces[0][0] > max(i for i, n in enumerate(order) if n.endswith("_end") and n[0] == "B")


def last_backward_span(run: dict) -> tuple[int, int]:
    order = names(run)
    start = backward_indices(run)[-1]
    return start, order.index(order[start] + "_end", start)


@on_ranks(4)
def test_overlap_grad_reduce_issues_bucket_all_reduces_while_the_last_backward_runs(ranks):
    """overlap_grad_reduce=True, no grad_sync_func: every stage leaves no_sync before its last backward and
    its buckets' asynchronous all-reduces start inside it; the first stage's first bucket before its first
    layer's backward. Only the first stage is bucketed (the others: one bucket per gradient buffer, one here)."""
    for run in runs("ddp_overlap"):
        start, end = last_backward_span(run)
        reduces = dp_all_reduces(run)
        assert reduces and all(start < i < end and e[3] is True for i, e in reduces), (start, end, reduces)
        if run["first"]:
            layer_boundary = names(run).index("bwd_layer1_done", start)
            assert reduces[0][0] < layer_boundary < reduces[1][0], names(run)[start : end + 1]


@on_ranks(4)
def test_with_grad_sync_func_only_the_first_stage_reduces_in_its_last_backward_the_others_in_the_bubble(ranks):
    """grad_sync_func = start_grad_sync (megatron training under overlap_grad_reduce and its default
    align_grad_reduce): later stages keep no_sync through their last backward and issue their all-reduce
    after it, while the first stage is still draining the pipeline."""
    by_stage = runs("ddp_overlap_align")
    first = [run for run in by_stage if run["first"]]
    for run in by_stage:
        start, end = last_backward_span(run)
        reduces, order = dp_all_reduces(run), names(run)
        if run["first"]:
            assert reduces and all(start < i < end for i, _ in reduces) and "grad_sync_func" not in order
            continue
        assert order.index("no_sync_exit") > end and "grad_sync_func" in order
        assert [i for i, _ in reduces] and all(
            order.index("grad_sync_func") < i < order.index("finalize_enter") for i, _ in reduces
        )
        issued = run["events"][reduces[0][0]][-1]
        for stage0 in first:  # this stage is idle until the first stage's last backward ends: its bubble
            assert run["events"][end][-1] < issued < stage0["events"][last_backward_span(stage0)[1]][-1]


@on_ranks(4)
def test_each_loss_is_divided_by_num_microbatches_before_backward(ranks):
    """Two outputs: loss x cp / m (cp = 1 here; cp > 1 in the forward_step test above). Three: loss / num_tokens /
    m, unless calculate_per_token_loss, where backward starts from the sum and megatron's finalize_model_grads
    divides the gradients by the global token count."""
    for name, divide in [
        ("defaults_m6", lambda loss, tokens, m: loss / m),
        ("three_output_m6", lambda loss, tokens, m: loss / tokens / m),
        ("per_token_m6", lambda loss, tokens, m: loss),
    ]:
        last = runs(name)[-1]
        assert last["last"]
        losses = {e[1]: e for e in last["events"] if e[0] == "loss"}
        starts = [e for e in last["events"] if e[0][0] == "B" and not e[0].endswith("_end")]
        assert len(starts) == last["m"] == len(losses)
        for e in starts:
            loss = losses[int(e[0][1:])]
            tokens = loss[3] if len(loss) > 4 else None
            assert e[2] == pytest.approx(divide(loss[2], tokens, last["m"]), rel=1e-6), (name, e, loss)
        finalize = next(e for e in last["events"] if e[0] == "finalize_enter")
        assert finalize[1] == (6 * 8 if name == "per_token_m6" else False), finalize
    for per_token, per_micro_batch in zip(runs("per_token_m6"), runs("three_output_m6")):
        # finalize_model_grads divided the summed gradients by the 48 tokens: the same as / 8 / m here
        flat = [[x for grad in run["grads"] for x in grad] for run in (per_token, per_micro_batch)]
        assert flat[0] == pytest.approx(flat[1], rel=1e-5, abs=1e-7)


class LastStage(torch.nn.Module):
    """A last stage of one Linear on the activation the schedule hands it (set_input_tensor)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(8)
        self.linear, self.input_tensor = torch.nn.Linear(H, H), None

    def set_input_tensor(self, tensors):
        self.input_tensor = tensors[0]

    def forward(self):
        return self.linear(self.input_tensor)


def test_a_two_output_loss_is_multiplied_by_the_context_parallel_size_and_divided_by_m():
    """The full schedule above runs at cp = 1; here its own forward_step runs the last stage at cp = 1, 2 and 4
    (the 1F1B schedule passes pg_collection.cp.size()), to tell "times cp, over m" from "over m times cp"."""
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=1)
    model, x, m = LastStage(), torch.randn(S, B, H, generator=torch.Generator().manual_seed(9)), 4

    def step(data_iterator, model):
        return model(), lambda output: (output.pow(2).mean(), {"loss": output.pow(2).mean().detach()})

    for cp in (1, 2, 4):
        store = []
        loss, _ = schedules.forward_step(step, None, model, m, x, store, config, cp_group_size=cp, is_last_stage=True)
        assert loss.item() == pytest.approx(store[0]["loss"].item() * cp / m, rel=1e-6), cp


@on_ranks(4)
def test_deallocate_pipeline_outputs_is_off_by_default_and_shrinks_sent_outputs_to_one_element(ranks):
    defaults, deallocated = runs("defaults_m6"), runs("deallocate_m6")
    for plain, freed in zip(defaults, deallocated):
        assert plain["defaults"]["deallocate_pipeline_outputs"] is False
        sizes = {e[1] for e in plain["events"] if e[0][0] == "B" and not e[0].endswith("_end")}
        freed_sizes = {e[1] for e in freed["events"] if e[0][0] == "B" and not e[0].endswith("_end")}
        assert freed_sizes == {1} and sizes == ({1} if plain["last"] else {4 * 2 * 8}), (sizes, freed_sizes)
        assert freed["grads"] == plain["grads"]  # custom_backward gives the same gradients
    assert "Mismatch in shape" in logs()[0]["deallocated_plain_backward"]


@on_ranks(4)
def test_the_interleaved_schedule_picked_for_virtual_stages_idles_v_times_less(ranks):
    """get_forward_backward_func picks forward_backward_pipelining_with_interleaving when virtual stages are set;
    its recorded order at p 4, v 2 chunks, m 8 idles (p - 1)/(v m + p - 1), against (p - 1)/(m + p - 1)."""
    by_pp_rank = sorted(logs(), key=lambda r: r["runs"]["defaults_m6"]["pp_rank"])
    assert by_pp_rank[0]["with_virtual_stages"] == "forward_backward_pipelining_with_interleaving"
    p, v, m = 4, 2, 8
    interleaved = idle_fraction([r["interleaved_v2_m8"] for r in by_pp_rank], chunks=v)
    plain = idle_fraction([r["defaults_m8"] for r in by_pp_rank])
    assert interleaved == pytest.approx((p - 1) / (v * m + p - 1)) and plain == pytest.approx((p - 1) / (m + p - 1))


@on_ranks(4)
def test_megatron_ddp_buckets_only_the_first_stage_and_reduces_in_the_parameters_dtype(ranks):
    for run in runs("ddp_overlap"):  # a bucket per layer asked for: granted on the first stage only
        assert run["buckets"] == (2 if run["first"] else 1), run["buckets"]
    for rank in logs():  # without overlap_grad_reduce no stage is bucketed, the first included
        assert rank["buckets_without_overlap"] == 1, rank["buckets_without_overlap"]
    for rank in logs():
        assert rank["bf16_grad_dtypes"] == {"default": "torch.bfloat16", "grad_reduce_in_fp32": "torch.float32"}
    for rank in logs():  # a later stage: not one bucket in all, one per gradient buffer (per dtype)
        if not rank["runs"]["ddp_overlap"]["first"]:
            assert rank["two_dtype_buckets"] == {"buffers": 2, "buckets": 2}, rank["two_dtype_buckets"]


@on_ranks(4)
@pytest.mark.parametrize("v, m", [(2, 8), (2, 4), (3, 4)])
def test_megatron_interleaved_order_is_the_reference_interleaved_1f1b(ranks, v, m):
    """forward_backward_pipelining_with_interleaving at p 4 (v chunks; m 4 puts every forward of rank 0 in the
    warm-up) runs on each rank the order reference.pipeline.interleaved runs on the same PP group."""
    by_pp_rank = sorted(logs(), key=lambda r: r["runs"]["defaults_m6"]["pp_rank"])
    megatron = [r[f"interleaved_v{v}_m{m}"] for r in by_pp_rank]
    assert megatron == [r["reference_interleaved"][f"v{v}_m{m}"] for r in by_pp_rank]
    p = len(megatron)
    for r, order in enumerate(megatron):  # the warm-up of get_pp_rank_microbatches, then one F per B
        warmup = min(2 * (p - r - 1) + (v - 1) * p, v * m)
        assert next((i for i, a in enumerate(order) if a[0] == "B"), len(order)) == min(warmup + 1, v * m)


@on_ranks(4)
def test_megatron_refuses_interleaving_when_m_is_not_a_multiple_of_p(ranks):
    """Its default microbatch_group_size_per_vp_stage is p; m 6 at p 4 leaves a last group of 2 < p, and m 2 < p
    fails the group-size range check before the remainder is looked at."""
    for rank in logs():
        assert rank["interleaved_m2_refused"].startswith("ValueError: The number of contiguous micro-batches"), rank[
            "interleaved_m2_refused"
        ]
        assert rank["interleaved_m6_refused"].startswith("RuntimeError: The remainder of M"), rank[
            "interleaved_m6_refused"
        ]
        assert "but it is 2" in rank["interleaved_m6_refused"]


@pytest.mark.parametrize("v, m", [(2, 8), (3, 4)])
def test_overlap_moe_expert_parallel_comm_adds_one_interleaved_warmup_forward(v, m):
    """get_pp_rank_microbatches (in-process: a stand-in communicator gives p, r and v) warms rank r up with
    2(p - r - 1) + (v - 1)p chunk-forwards, one more under overlap_moe_expert_parallel_comm (combined 1F1B), at
    most v·m either way; without virtual stages (1F1B) the flag changes nothing."""
    from types import SimpleNamespace

    p = 4
    for r in range(p):
        for virtual, plain in [(v, 2 * (p - r - 1) + (v - 1) * p), (None, p - r - 1)]:
            group = SimpleNamespace(size=lambda: p, rank=lambda r=r: r)
            comm = SimpleNamespace(pp_group=group, virtual_pipeline_model_parallel_size=virtual)
            chunks = v if virtual else 1
            warmup = {
                overlap: schedules.get_pp_rank_microbatches(
                    m, chunks, p, overlap_moe_expert_parallel_comm=overlap, p2p_communicator=comm
                )[2]
                for overlap in (False, True)
            }
            extra = 1 if virtual else 0
            assert warmup == {False: min(plain, chunks * m), True: min(plain + extra, chunks * m)}, (r, virtual)


def test_megatron_assigns_chunk_c_of_rank_r_the_layers_of_virtual_stage_c_p_plus_r():
    """get_transformer_layer_offset / get_num_layers_to_build (in-process, no ranks needed) give the split of
    reference.gpt.model.split_virtual_stages, and refuse layer counts that p x v does not divide."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from reference.gpt.model import split_virtual_stages

    for layers, p, v in [(8, 2, 2), (8, 2, 4), (12, 4, 3), (8, 4, 2)]:
        config = TransformerConfig(
            num_layers=layers,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=p,
            virtual_pipeline_model_parallel_size=v,
        )
        megatron = [
            [
                (
                    get_transformer_layer_offset(config, vp_stage=c, pp_rank=r),
                    get_transformer_layer_offset(config, vp_stage=c, pp_rank=r)
                    + get_num_layers_to_build(config, vp_stage=c, pp_rank=r),
                )
                for c in range(v)
            ]
            for r in range(p)
        ]
        assert megatron == split_virtual_stages(layers, p, v), (layers, p, v)
    # two assertions: the layers must split over p stages, then each stage's over v chunks
    for p, v, message in [(4, 2, "divisible by pipeline_model_parallel_size"), (2, 2, "divisible by vp_size")]:
        config = TransformerConfig(
            num_layers=6,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=p,
            virtual_pipeline_model_parallel_size=v,
        )
        with pytest.raises(AssertionError, match=message):
            get_num_layers_to_build(config, vp_stage=0, pp_rank=0)


def test_layer_counts_that_p_times_v_does_not_divide_build_off_the_default_even_split():
    """The divisibility by p x v is the default even split's: sizing the first and last stages by hand, or
    counting the embedding as a layer, builds 10 and 7 layers at p 2, v 2 (in-process, no ranks needed)."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    for layers, layout, chunks in [
        (10, {"num_layers_in_first_pipeline_stage": 4, "num_layers_in_last_pipeline_stage": 6}, [[2, 2], [3, 3]]),
        (7, {"account_for_embedding_in_pipeline_split": True}, [[1, 2], [2, 2]]),
    ]:
        assert layers % 4 != 0
        config = TransformerConfig(
            num_layers=layers,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            **layout,
        )
        built = [[get_num_layers_to_build(config, vp_stage=c, pp_rank=r) for c in range(2)] for r in range(2)]
        assert built == chunks and sum(map(sum, built)) == layers


def peak_held(order: list[str]) -> int:
    """The most forwards whose backward has not run yet: what the stage keeps in input_tensors/output_tensors."""
    held, peak = 0, 0
    for action in order:
        held += 1 if action[0] == "F" else -1
        peak = max(peak, held)
    return peak


@on_ranks(4)
def test_at_p4_m8_stage_0_holds_4_micro_batches_under_1f1b_and_11_half_stage_chunks_interleaved(ranks):
    """Memory in flight, from megatron's recorded orders at p 4, m 8: 1F1B keeps min(p - r, m) whole-stage
    forwards; interleaving (v 2) keeps its warm-up plus one chunk-forward of half a stage each, so rank 0 holds
    5.5 stages' worth against 4, and every rank holds more than under 1F1B."""
    by_pp_rank = sorted(logs(), key=lambda r: r["runs"]["defaults_m6"]["pp_rank"])
    p, v, m = 4, 2, 8
    plain = [peak_held(r["defaults_m8"]) for r in by_pp_rank]
    interleaved = [peak_held(r["interleaved_v2_m8"]) for r in by_pp_rank]
    assert plain == [min(p - r, m) for r in range(p)] == [4, 3, 2, 1]
    assert interleaved == [min(2 * (p - r - 1) + (v - 1) * p + 1, v * m) for r in range(p)] == [11, 9, 7, 5]
    assert all(chunks / v > whole for chunks, whole in zip(interleaved, plain))


@on_ranks(4)
@pytest.mark.parametrize("v, m", [(2, 8), (3, 4)])
def test_megatron_interleaved_first_backward_is_micro_batch_0_on_the_last_chunk(ranks, v, m):
    """The backward table mirrors the chunks: on every rank the first backward is micro-batch 0's on chunk
    v - 1 (its last virtual stage), preceded at p 4, v 2, m 8 on rank 0 by F0.0-F0.3, F1.0-F1.3, F0.4-F0.6."""
    by_pp_rank = sorted(logs(), key=lambda r: r["runs"]["defaults_m6"]["pp_rank"])
    orders = [r[f"interleaved_v{v}_m{m}"] for r in by_pp_rank]
    for order in orders:
        assert next(a for a in order if a[0] == "B") == f"B{v - 1}.0", order
    if (v, m) == (2, 8):
        first = orders[0]
        leading = first[: first.index("B1.0")]
        assert leading == [f"F0.{i}" for i in range(4)] + [f"F1.{i}" for i in range(4)] + ["F0.4", "F0.5", "F0.6"]


def test_uneven_stages_give_the_last_stage_fewer_layers_for_the_loss():
    """The pipeline walkthrough's remedy for a last stage slowed by the LM head and loss: megatron-core splits
    7 layers over 4 stages as 2, 2, 2, 1 when told the last stage's count, or to count the loss as a layer;
    its default split of 8 is even."""

    def layers_per_stage(num_layers: int, **split) -> list[int]:
        config = TransformerConfig(
            num_layers=num_layers,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=4,
            pipeline_dtype=torch.float32,
            **split,
        )
        return [get_num_layers_to_build(config, pp_rank=rank) for rank in range(4)]

    assert layers_per_stage(8) == [2, 2, 2, 2]
    assert layers_per_stage(7, num_layers_in_last_pipeline_stage=1) == [2, 2, 2, 1]
    assert layers_per_stage(7, account_for_loss_in_pipeline_split=True) == [2, 2, 2, 1]
