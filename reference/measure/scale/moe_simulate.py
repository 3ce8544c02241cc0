"""Trace one training step of the MoE layers of one rank of a large job with expert parallelism, in one process.

Like simulate.py, through torch's `fake` backend on the meta device: the rank builds its stage's MoE layers
(reference.moe.MoELayer, parallelize_moe over its EP and TP groups), runs m micro-batches forward and backward
through them as a residual stack, reduces the gradients (routers over DP and, under TP, over TP; experts over
the expert-DP group, each with the reference's DDP) and steps Adam behind fp32 masters. The router, the
dispatcher and the experts are the reference's; permute and combine, index operations without communication,
are shape-equal stand-ins (meta tensors hold no routing to index by), and the dispatcher's token counts are the
stated routing's (stated_peers).
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from reference.data_parallel.distributed_optimizer import bytes_per_rank
from reference.data_parallel.mixed_precision import unsharded
from reference.data_parallel.wrapper import DistributedDataParallel
from reference.measure.recorder import CollectiveEvent, CollectiveRecorder
from reference.measure.scale import moe_formulas, simulate
from reference.measure.scale.moe_shapes import MoESetup
from reference.measure.scale.routing import imbalance
from reference.measure.scale.shapes import DTYPES
from reference.measure.scale.simulate import RankStep, Row, adam, agree, rows_document, rows_of, stage_of
from reference.moe import dispatcher as dispatcher_module
from reference.moe.layer import MoELayer
from reference.moe.parallelize import parallelize_moe
from reference.parallel_state import Mesh, ParallelLayout, build_layout
from reference.tensor_parallel import collectives
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads

GROUPS = ("ep", "tp", "dp", "edp")
LABELS = {"ep": "EP (all-to-all)", "tp": "TP", "dp": "DP (router)", "edp": "expert DP"}


@contextlib.contextmanager
def stated_peers():
    """The fake backend's collectives bring back nothing from the peers. Under the stated routing every rank
    routes the same counts, so what the peers would send is known: in the count all-to-all over EP each sends
    this rank's own row (its pairs for this rank's experts), and over TP each has received the same. Both
    collectives are still issued (and recorded); only what they return is replaced. Token rows pass through."""
    exchange, gather = dispatcher_module.all_to_all, collectives.gather_first_dim

    def counts_all_to_all(x, group, output_splits, input_splits):
        out = exchange(x, group, output_splits, input_splits)
        return out if x.is_floating_point() else x.view(group.size(), -1)[group.rank()].repeat(group.size())

    def counts_gather(x, group):
        out = gather(x, group)
        return out if x.is_floating_point() else x.repeat(group.size(), *[1] * (x.dim() - 1))

    with (
        mock.patch.object(dispatcher_module, "all_to_all", counts_all_to_all),
        mock.patch.object(collectives, "gather_first_dim", counts_gather),
    ):
        yield


def moe_sublayer(layer: MoELayer, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x + the MoE layer's output, routing `counts` pairs to each expert (MoELayer.forward, with permute and
    combine as shape-equal stand-ins: the T k routed rows, and their top-k weighted sum per token)."""
    tokens = x.reshape(-1, layer.hidden_size)
    probs, _ = layer.router(tokens)  # the gate, top-k, and the load-balancing loss's count over TP
    k = layer.router.topk
    weights = probs.topk(k, dim=1).values
    permuted = tokens.repeat_interleave(k, dim=0)
    rows, tokens_per_expert = layer.dispatcher.dispatch(permuted, counts)
    rows = layer.dispatcher.combine(layer.experts(rows, tokens_per_expert))
    out = (rows.view(-1, k, layer.hidden_size) * weights.unsqueeze(-1)).sum(dim=1)
    return x + out.view_as(x)


def ep_rank_of(setup: MoESetup, rank: int) -> int:
    return Mesh(setup.tp, setup.pp, setup.dp, ep=setup.ep, order=setup.order).where(rank, "expert")["ep"]


def default_ranks(setup: MoESetup) -> list[int]:
    """TP rank 0 of expert-DP replica 0 on the first stage: EP rank 0 (the hottest experts) and the last."""
    grid = Mesh(setup.tp, setup.pp, setup.dp, ep=setup.ep, order=setup.order).expert
    return [int(grid[0, 0, e, 0]) for e in sorted({0, setup.ep - 1})]


def _label(event: CollectiveEvent, layout: ParallelLayout) -> str:
    """The group an event ran on: the two DDPs' reductions by their scope; all-to-alls are EP's; else by ranks."""
    if event.module in ("dp", "edp"):
        return event.module
    if event.op == "all_to_all":
        return "ep"
    return layout.group_kind(event.group_ranks)


def trace_rank(setup: MoESetup, rank: int, held: dict | None = None) -> list[CollectiveEvent]:
    """Every collective `rank` issues in one step of its stage's MoE layers; `held` receives the bytes it holds."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=setup.world)
    try:
        layout = build_layout(setup.tp, setup.pp, setup.dp, order=setup.order, ep_size=setup.ep)
        m, meta, dtype = setup.model, torch.device("meta"), DTYPES[setup.model.dtype]
        num_layers = moe_formulas.stage_layers(setup, stage_of(setup, rank))
        with meta:
            layers = torch.nn.ModuleList(
                parallelize_moe(
                    MoELayer(
                        m.hidden_size,
                        m.ffn_hidden_size,
                        m.num_experts,
                        m.topk,
                        gated=True,
                        aux_loss_coeff=m.aux_loss_coeff,
                        params_dtype=dtype,
                        device=meta,
                    ),
                    layout,
                )
                for _ in range(num_layers)
            )
        routers = torch.nn.ModuleList(layer.router for layer in layers)
        experts = torch.nn.ModuleList(layer.experts for layer in layers)
        expert_group = layout.expert_dp_group if setup.ep > 1 else layout.dp_group
        wrapped = [  # megatron's DDP: dense parameters over DP, expert-parallel ones over expert DP
            DistributedDataParallel(routers, layout.dp_group, bucket_size=setup.bucket_size, overlap_grad_reduce=False),
            DistributedDataParallel(experts, expert_group, bucket_size=setup.bucket_size, overlap_grad_reduce=False),
        ]
        optimizer = unsharded(wrapped, adam)
        counts = torch.tensor(moe_formulas.counts(setup))
        recorder = CollectiveRecorder()
        with recorder, stated_peers():
            for _ in range(setup.microbatches):
                x = torch.empty(m.seq_length // setup.tp, m.micro_batch_size, m.hidden_size, dtype=dtype, device=meta)
                y = x.requires_grad_()
                for layer in layers:
                    y = moe_sublayer(layer, y, counts)
                y.float().sum().backward()
            for ddp, scope in zip(wrapped, ("dp", "edp")):
                with recorder.scope(scope):
                    ddp.finish_grad_sync()
            if setup.tp > 1:
                allreduce_sequence_parallel_grads(routers, layout.tp_group)
        optimizer.step()
        if held is not None:
            held.update(_held(wrapped, optimizer, routers, experts))
        return [dataclasses.replace(e, module=_label(e, layout)) for e in recorder.events]
    finally:
        dist.destroy_process_group()


def _held(wrapped, optimizer, routers, experts) -> dict[str, int]:
    total = bytes_per_rank(wrapped, optimizer)
    size = lambda module: sum(p.numel() * p.element_size() for p in module.parameters())
    return {
        "expert_parameters": size(experts),
        "router_parameters": size(routers),
        "gradients": total["gradients"],
        "master_weights": total["master_weights"],
        "optimizer_states": total["optimizer_states"],
    }


def summarize(setup: MoESetup, rank: int, events: list[CollectiveEvent]) -> list[Row]:
    """One Row per (group, op) seen or predicted, in group then op order."""
    return rows_of(events, moe_formulas.expected(setup, stage_of(setup, rank), ep_rank_of(setup, rank)), GROUPS)


def step_of(setup: MoESetup, rank: int) -> RankStep:
    return simulate.step_of(setup, rank, trace_rank)


def document(setup: MoESetup, steps: list[RankStep]) -> dict:
    """The JSON a MoE scale trace is stored as (reading_notes/traces/moe_scale_*.json): a "scale" trace (the site's
    scale_table and chart_sent_per_group read it) with its groups, their sizes, and the stated routing."""
    runs = []
    for step in steps:
        stage, ep_rank = stage_of(setup, step.rank), ep_rank_of(setup, step.rank)
        busy = "hottest experts" if ep_rank == 0 else "coldest experts" if ep_rank == setup.ep - 1 else "experts"
        without_ep = dataclasses.replace(setup, ep=1)
        runs.append(
            {
                "rank": step.rank,
                "stage": stage,
                "ep_rank": ep_rank,
                "label": f"EP rank {ep_rank} ({busy})" if setup.ep > 1 else f"rank {step.rank}",
                "memory": {
                    "measured": step.held,
                    "formula": moe_formulas.memory(setup, stage),
                    "without_ep": moe_formulas.memory(without_ep, stage),
                },
                **rows_document(summarize(setup, step.rank, step.events), moe_formulas.expected(setup, stage, ep_rank)),
            }
        )
    counts = moe_formulas.counts(setup)
    return {
        "kind": "scale",
        "setup": setup.to_dict(),
        "world": setup.world,
        "groups": {g: LABELS[g] for g in GROUPS},
        "group_sizes": {"ep": setup.ep, "tp": setup.tp, "dp": setup.dp, "edp": setup.edp},
        "routing": {
            "distribution": "zipf",
            "skew": setup.routing_skew,
            "tokens": setup.tokens,
            "topk": setup.model.topk,
            "counts": counts,
            **imbalance(counts, setup.ep),
        },
        "runs": runs,
        "agree": agree(runs),
    }
