"""One 3D-parallel optimizer step: DP replicas take their rows, micro-batches go through the pipeline.

Each DP replica takes its rows of the global batch and cuts them into m micro-batches; the schedule runs them
with every backward but the last under the DDP wrapper's `no_sync`, `finalize_model_grads` waits for the
reductions, and the optimizer steps. The gradient is the global batch's mean token loss, whatever tp, pp, dp
and m are. With `fully_sharded` (FSDP over DP x TP), or the reference FSDP2 over DP x TP
(reference.data_parallel.fsdp2_tp), a step is one micro-batch at pp 1.

Mirrors Megatron-LM's training loop, which hands
`megatron-lm:megatron/core/pipeline_parallel/schedules.py::get_forward_backward_func`'s schedule the same two
hooks (notes/reference/gpt.train.md: the batch's path, the reported loss, and where the overlap differs).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist

from reference.context_parallel.parallelize import shard_micro_batch
from reference.data_parallel import DistributedDataParallel, finalize_model_grads
from reference.data_parallel.buckets import GradBucket
from reference.data_parallel.fsdp_tp import shard_tp_model
from reference.data_parallel.mixed_precision import model_chunks
from reference.data_parallel.wrapper import DEFAULT_BUCKET_SIZE
from reference.fsdp import FullyShardedDataParallel
from reference.fsdp2 import FSDPModule
from reference.gpt.model import GPT, GPTConfig
from reference.parallel_state import ParallelConfigError, ParallelLayout
from reference.pipeline.schedules import forward_backward, loss_values
from reference.pipeline.zero_bubble import V_SCHEDULES
from reference.synthetic_data import random_token_batches


def synthetic_batches(config: GPTConfig, steps: int, global_batch_size: int, seed: int) -> list[torch.Tensor]:
    """`steps` global batches of random tokens [B, s + 1] (inputs and shifted labels), identical on every rank
    for a given seed."""
    return random_token_batches(config.vocab_size, steps, global_batch_size, config.seq_length + 1, seed)


def split_batch(
    tokens: torch.Tensor, dp_size: int, dp_rank: int, num_micro_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This replica's rows of the global batch as m (inputs, labels) micro-batches."""
    rows, m = tokens.shape[0], num_micro_batches
    if m < 1 or rows % (dp_size * m):
        raise ParallelConfigError(
            f"a global batch of {rows} sequences does not split into dp {dp_size} x "
            f"{m} micro-batches of equal size; use a multiple of {dp_size * max(m, 1)}"
        )
    mine = tokens.chunk(dp_size)[dp_rank]
    return [(chunk[:, :-1], chunk[:, 1:]) for chunk in mine.chunk(m)]


def global_loss(
    losses: list[float], layout: ParallelLayout, device: torch.device, loss_pp_rank: int | None = None
) -> float:
    """The global batch's mean loss on every rank, from the last stage's micro-batch `losses` (see the module
    docstring), held by PP rank `loss_pp_rank` (default the last; in a V, the first)."""
    loss_pp_rank = layout.pp_size - 1 if loss_pp_rank is None else loss_pp_rank
    loss = torch.tensor(sum(losses) / len(losses) if losses else 0.0, device=device)
    replicas = layout.dp_size * layout.size("cp")  # each cp rank's loss is its shard's mean: average them too
    if layout.pp_rank == loss_pp_rank and replicas > 1:
        dist.all_reduce(loss, group=layout.group("dp_cp"))
        loss /= replicas
    if layout.pp_size > 1:
        dist.broadcast(loss, src=dist.get_global_rank(layout.pp_group, loss_pp_rank), group=layout.pp_group)
    return loss_values([loss])[0]


def data_parallel(
    stage: GPT,
    layout: ParallelLayout,
    *,
    bucket_size: int | None = DEFAULT_BUCKET_SIZE,
    overlap_grad_reduce: bool = True,
    use_distributed_optimizer: bool = False,
    grad_dtype: torch.dtype | None = None,
    bucket_class: type[GradBucket] = GradBucket,
) -> DistributedDataParallel:
    """The stage wrapped for gradient averaging over the layout's DP (x CP) group (bucketed, optionally overlapped;
    reduce-scattered for reference.data_parallel.distributed_optimizer.DistributedOptimizer, into a
    `bucket_class` of reference.data_parallel.gradient_shards for ZeRO-2; in `grad_dtype`,
    default the parameters', e.g. fp32 main grads for bf16 parameters)."""
    return DistributedDataParallel(
        stage,
        layout.group("dp_cp"),
        bucket_size=bucket_size,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=use_distributed_optimizer,
        grad_dtype=grad_dtype,
        bucket_class=bucket_class,
    )


def fully_sharded(stage: GPT, layout: ParallelLayout, **fsdp_kwargs) -> FullyShardedDataParallel:
    """The stage sharded by reference FSDP over the layout's DP group, TP inside (one unit per block, the
    embedding and head in the root unit). train_step trains it with one micro-batch per step. `fsdp_kwargs`
    go to every unit, e.g. mixed_precision=MixedPrecision(param_dtype=torch.bfloat16,
    reduce_dtype=torch.float32): bf16 compute over fp32 shards (the optimizer's master weights), gradients
    reduce-scattered in fp32."""
    return shard_tp_model(stage, layout, **fsdp_kwargs)


def train_step(
    model: DistributedDataParallel | FullyShardedDataParallel | FSDPModule | list[DistributedDataParallel],
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    layout: ParallelLayout,
    *,
    num_micro_batches: int,
    schedule: str = "1f1b",
    device: torch.device | None = None,
    record: contextlib.AbstractContextManager | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    finalize_grads: Callable[[], None] | None = None,
    observer=None,
) -> float:
    """One optimizer step on the global batch `tokens` [B, s + 1] for a stage wrapped by `data_parallel` or
    `fully_sharded` (or `fully_shard`-ed by reference.data_parallel.fsdp2_tp), or for a list of v > 1 model
    chunks each wrapped by `data_parallel` (interleaved 1F1B). `no_sync` defaults to the DDP wrappers' (all
    chunks at once; FSDP: nothing to defer, one micro-batch), `finalize_grads` to finalize_model_grads (any of
    them). `record` is a context (e.g. a CollectiveRecorder)
    around the training work only: schedule, gradient finalization and optimizer step; `observer` goes to the
    schedule (e.g. reference.measure.pipeline_meter.PipelineMeter). Returns the global batch's mean loss.

    Mirrors `megatron-lm:megatron/core/pipeline_parallel/schedules.py::get_forward_backward_func`.
    """
    device = device or torch.device("cpu")
    chunks = model_chunks(model)
    if isinstance(model, (FullyShardedDataParallel, FSDPModule)) and num_micro_batches > 1:
        raise ParallelConfigError(
            f"a fully_sharded stage trains one micro-batch per step, got {num_micro_batches}: "
            "the reference FSDP has no no_sync to defer its reduce-scatters"
        )
    if no_sync is None:
        no_sync = (
            functools.partial(_all_no_sync, chunks)
            if isinstance(chunks[0], DistributedDataParallel)
            else contextlib.nullcontext
        )
    micro_batches = [
        tuple(t.to(device) for t in shard_micro_batch(x, y, layout))
        for x, y in split_batch(tokens, layout.dp_size, layout.dp_rank, num_micro_batches)
    ]
    with record or contextlib.nullcontext():
        losses = forward_backward(
            schedule,
            model,
            micro_batches,
            pp_group=layout.pp_group,
            activation_shape=stage_of(chunks[0]).activation_shape(micro_batches[0][0].shape[0]),
            no_sync=no_sync,
            finalize_grads=finalize_grads or (lambda: finalize_model_grads(chunks, layout.tp_group)),
            dtype=stage_of(chunks[0]).params_dtype,
            device=device,
            observer=observer,
        )
        optimizer.step()
    for chunk in chunks:
        chunk.zero_grad()
    return global_loss(losses, layout, device, 0 if schedule in V_SCHEDULES else None)


def stage_of(chunk: DistributedDataParallel | FullyShardedDataParallel | FSDPModule) -> GPT:
    """The GPT stage a chunk trains: DDP and FSDP1 wrap it (`.module`); `fully_shard` changes the stage's own
    class, so an FSDP2 chunk is the stage."""
    return chunk if isinstance(chunk, FSDPModule) else chunk.module


def _all_no_sync(chunks: list[DistributedDataParallel]) -> contextlib.ExitStack:
    """Every chunk's no_sync at once (megatron: config.no_sync_func as a list, entered by multi_no_sync)."""
    stack = contextlib.ExitStack()
    for chunk in chunks:
        stack.enter_context(chunk.no_sync())
    return stack
