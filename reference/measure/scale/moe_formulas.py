"""Closed-form counts and bytes of the MoE layers' collectives in one training step, per process group and
collective type, and the bytes a rank holds: what reference.measure.scale.moe_simulate records must equal
these, row by row (the MoE counterpart of formulas.py, beside it).

Per micro-batch and MoE layer a rank routes T tokens to k experts each (T k pairs), sends C_j of them to EP
rank j and receives R = ep C_me (reference.measure.scale.routing). Bytes follow the recorder (an all-to-all
counts its input). Groups: "ep" (the dispatcher's all-to-alls), "tp" (expert TP), "dp" (the router, a dense
parameter) and "edp" (the experts' gradients over the expert-data-parallel group, dp / ep ranks, as
`megatron-lm:megatron/core/distributed/distributed_data_parallel.py::DistributedDataParallel.__init__` reduces
its expert-parallel buffers). The Scale note derives every term.
"""

from __future__ import annotations

import dataclasses

from reference.gpt.model import split_layers
from reference.measure.scale.formulas import FP32, Term, _exact, ddp_buckets
from reference.measure.scale.moe_shapes import MoESetup
from reference.measure.scale.routing import ep_rank_pairs, expert_counts

COUNT = 8  # bytes of one token count (int64, as routing_map.sum() gives it)


def stage_layers(setup: MoESetup, stage: int) -> int:
    """MoE layers on pipeline stage `stage` (1F1B's split: num_layers / p, one more on the first num_layers mod p)."""
    first, last = split_layers(setup.model.num_layers, setup.pp)[stage]
    return last - first


@dataclasses.dataclass(frozen=True)
class SentTerm(Term):
    """A Term of an all-to-all, with the bytes that leave the rank (its rows for itself stay)."""

    sent: int


def counts(setup: MoESetup) -> list[int]:
    """Pairs per expert from one rank's micro-batch: the stated routing."""
    m = setup.model
    return expert_counts(setup.tokens, m.topk, m.num_experts, setup.routing_skew)


def received(setup: MoESetup, ep_rank: int) -> int:
    """R: the rows EP rank `ep_rank` receives per layer and micro-batch, ep times what each peer sends it."""
    return setup.ep * ep_rank_pairs(counts(setup), setup.ep)[ep_rank]


def expert_parameters(setup: MoESetup, stage: int) -> list[int]:
    """Sizes of this rank's expert weights in module order: per layer, per local expert, fc1 [2f/t, h] (SwiGLU's
    gate and up) and fc2 [h, f/t]."""
    h, f = setup.model.hidden_size, setup.model.ffn_hidden_size // setup.tp
    return [2 * f * h, h * f] * setup.local_experts * stage_layers(setup, stage)


def router_parameters(setup: MoESetup, stage: int) -> list[int]:
    """Sizes of the routers' weights [E, h], one per layer, replicated on every rank."""
    return [setup.model.num_experts * setup.model.hidden_size] * stage_layers(setup, stage)


def expected(setup: MoESetup, stage: int, ep_rank: int) -> dict[tuple[str, str], list[Term]]:
    """{(group, op): [Term, ...]} for the rank at pipeline stage `stage` and EP rank `ep_rank`."""
    model, e, t, ep = setup.model, setup.dtype_bytes, setup.tp, setup.ep
    n, E, h = setup.microbatches * stage_layers(setup, stage), model.num_experts, model.hidden_size
    pairs, R = setup.tokens * model.topk, received(setup, ep_rank)
    own = ep_rank_pairs(counts(setup), ep)[ep_rank]  # rows each token all-to-all keeps on this rank
    rows: dict[tuple[str, str], list[Term]] = {}

    def add(group, op, count, nbytes, formula, sent=None):
        """`count` collectives of `nbytes` bytes each (and `sent` bytes each leaving the rank)."""
        term = (
            Term(count, count * nbytes, formula)
            if sent is None
            else SentTerm(count, count * nbytes, formula, count * sent)
        )
        rows.setdefault((group, op), []).append(term)

    if ep > 1:
        add("ep", "all_to_all", n, COUNT * E, "m L x 8E (token counts)", COUNT * (E - E // ep))
        add("ep", "all_to_all", 2 * n, pairs * h * e, "2 m L x Tkhe (dispatch fwd, combine bwd)", (pairs - own) * h * e)
        add("ep", "all_to_all", 2 * n, R * h * e, "2 m L x Rhe (combine fwd, dispatch bwd)", (R - own) * h * e)
    if t > 1:
        add("tp", "all_gather", n, COUNT * t * E, "m L x 8tE (received counts)")
        add("tp", "all_gather", 2 * n, t * R * h * e, "2 m L x tRhe (expert input fwd, output grad bwd)")
        add("tp", "reduce_scatter", 2 * n, t * R * h * e, "2 m L x tRhe (expert output fwd, input grad bwd)")
        if model.aux_loss_coeff > 0:
            add("tp", "all_reduce", n, FP32 * E, "m L x 4E (load-balancing loss: pairs per expert)")
        add("tp", "all_reduce", 1, e * sum(router_parameters(setup, stage)), "1 x LEhe (router grads, SP)")
    for group, size, sizes, what in (
        ("dp", setup.dp, router_parameters(setup, stage), "router"),
        ("edp", setup.edp, expert_parameters(setup, stage), "expert"),
    ):
        if size > 1:
            buckets = ddp_buckets(sizes, e, setup.bucket_size)
            limit = "one bucket" if setup.bucket_size is None else f"buckets of >= {_exact(setup.bucket_size)}"
            rows[(group, "all_reduce")] = [Term(len(buckets), sum(buckets), f"e x {what} params in {limit}")]
    return rows


def memory(setup: MoESetup, stage: int) -> dict[str, int]:
    """Bytes a rank holds: expert and router weights, their gradients, fp32 masters and Adam's two moments."""
    e = setup.dtype_bytes
    experts, routers = sum(expert_parameters(setup, stage)), sum(router_parameters(setup, stage))
    return {
        "expert_parameters": e * experts,
        "router_parameters": e * routers,
        "gradients": e * (experts + routers),
        "master_weights": 0 if e == FP32 else FP32 * (experts + routers),
        "optimizer_states": 2 * FP32 * (experts + routers),
    }
