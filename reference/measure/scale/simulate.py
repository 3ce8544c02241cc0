"""Trace one training step of one rank of a large job, in one process, in seconds.

The process joins a world of tp x pp x dp ranks through torch's `fake` process-group backend
(`pytorch:torch/testing/_internal/distributed/fake_pg.py::FakeStore`): every collective returns at once. It
builds only its own pipeline stage (or v chunks) on the meta device, shapes without storage, wraps it as
`torchrun ... -m reference` does (data parallel; Adam behind fp32 masters, whole or distributed; or FSDP2) and runs
reference.gpt.train.train_step under a CollectiveRecorder; each meta kernel runs once per op and input
shapes (meta_kernels.SameShapes), which halves a 70B trace. summarize() groups the collectives by process group
and type; the bytes the rank holds are compared with formulas.memory. The Scale note says what the fake backend
takes and what is left out of the trace.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from reference.data_parallel.distributed_optimizer import bytes_per_rank
from reference.fsdp2.state import STATE_ATTR
from reference.gpt.model import GPT
from reference.gpt.parallelize import stage_layers
from reference.gpt.train import train_step
from reference.measure.pipeline_meter import PipelineMeter
from reference.measure.recorder import CollectiveEvent, CollectiveRecorder
from reference.measure.scale import formulas
from reference.measure.scale.meta_kernels import SameShapes
from reference.measure.scale.shapes import ScaleSetup
from reference.parallel_state import Mesh, ParallelLayout, build_layout
from reference.parallelize import ParallelizeConfig, build_optimizer, parallelize

GROUPS = ("tp", "pp", "dp", "dp_shard", "dp_replicate")  # the last two: HSDP's groups inside DP


@dataclasses.dataclass(frozen=True)
class Row:
    """Measured and predicted traffic of one (group, collective type) for one rank and step."""

    group: str
    op: str
    count: int
    nbytes: int
    formula_count: int
    formula_nbytes: int
    formula: str

    @property
    def agrees(self) -> bool:
        return (self.count, self.nbytes) == (self.formula_count, self.formula_nbytes)


def stage_of(setup: ScaleSetup, rank: int) -> int:
    """Pipeline stage of a global rank in this layout (a ScaleSetup, or a MoESetup: tp, pp, dp, order)."""
    return Mesh(setup.tp, setup.pp, setup.dp, order=setup.order).where(rank)["pp"]


def shard_rank_of(setup: ScaleSetup, rank: int) -> int:
    """A global rank's place in its FSDP2 shard group: its DP index, or under HSDP its dp_shard index (rows of
    consecutive DP ranks)."""
    return _mesh(setup).where(rank)["dp_shard"]


def _mesh(setup: ScaleSetup) -> Mesh:
    return Mesh(setup.tp, setup.pp, setup.dp, dp_replicate=setup.dp_replicate, order=setup.order)


def adam(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    """Adam, one tensor at a time: its `step` counters stay on the CPU, which foreach would not mix with meta."""
    return torch.optim.Adam(tensors, lr=1e-4, foreach=False)


def trace_rank(
    setup: ScaleSetup, rank: int, device: str = "meta", held: dict | None = None, pipeline: dict | None = None
) -> list[CollectiveEvent]:
    """Every collective `rank` issues in one train_step (micro-batches through its stage, then the grad sync);
    `held`, if given, receives the bytes the rank holds (bytes_per_rank) after the step, and `pipeline` (pp > 1)
    the peak of forwards in flight as autograd held them (reference.measure.pipeline_meter).

    device "cpu" runs the same step on real tensors: only for small models, to show that the meta device
    changes nothing the recorder sees."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=setup.world)
    try:
        layout = build_layout(setup.tp, setup.pp, setup.dp, order=setup.order, dp_replicate=setup.dp_replicate)
        model, where = setup.model, torch.device(device)
        plan = ParallelizeConfig(
            sequence_parallel=setup.sp,
            dp_sharding=dp_sharding(setup),
            bucket_size=setup.bucket_size,
            bf16=setup.fsdp2 and setup.params_dtype == torch.bfloat16,  # FSDP2: fp32 shards, bf16 compute
        )
        params_dtype = torch.float32 if setup.fsdp2 else setup.params_dtype
        with where:  # the master weights the layers draw their shards from are plain torch.empty: meta too
            chunks = [
                GPT(model.gpt_config(), plan.seed, where, layers=layers, params_dtype=params_dtype)
                for layers in stage_layers(model.gpt_config(), layout, setup.virtual_stages, setup.schedule)
            ]
            wrapped = parallelize(chunks if len(chunks) > 1 else chunks[0], layout, plan)
        optimizer = build_optimizer(wrapped, plan, adam)
        grads: dict[int, int] = {}  # FSDP2's sharded gradients' storage: each group's reduce-scatter output
        if setup.fsdp2:
            optimizer.register_step_pre_hook(lambda *_: grads.update(_grad_buffers(wrapped)))
        rows = setup.dp * setup.microbatches * model.micro_batch_size
        tokens = torch.zeros(rows, model.seq_length + 1, dtype=torch.long, device=where)  # global batch
        recorder, meter = CollectiveRecorder(), None if setup.fsdp2 else PipelineMeter()
        with SameShapes() if device == "meta" else contextlib.nullcontext():  # outside the recorder: it sees every op
            train_step(
                wrapped,
                optimizer,
                tokens,
                layout,
                num_micro_batches=setup.microbatches,
                schedule=setup.schedule,
                device=where,
                record=recorder,
                # its two PP barriers frame the bubble, as in every recorded pipeline run
                observer=meter,
            )
        if pipeline is not None and meter is not None and setup.pp > 1:
            pipeline["peak_in_flight"] = meter.peak_in_flight_measured
        if held is not None:
            held.update(_fsdp2_held(wrapped, optimizer, grads) if setup.fsdp2 else bytes_per_rank(wrapped, optimizer))
        hsdp = {layout.members(kind): kind for kind in ("dp_shard", "dp_replicate")} if setup.dp_replicate > 1 else {}
        return _labelled(recorder.events, layout, hsdp)
    finally:
        dist.destroy_process_group()


def dp_sharding(setup: ScaleSetup) -> str:
    """The setup's DP form, as reference.parallelize names it."""
    if setup.fsdp2:
        return "fsdp2"
    return "gradients" if setup.shard_gradients else "optimizer" if setup.distributed_optimizer else "replicate"


def _fsdp2_held(sharded: torch.nn.Module, optimizer: torch.optim.Optimizer, grads: dict[int, int]) -> dict:
    """The bytes an FSDP2 rank holds: its padded shards, its sharded gradients, Adam's states (no masters)."""
    return dict(
        parameters=sum(p.padded_shard.numel() * p.padded_shard.itemsize for p in _sharded_params(sharded)),
        gradients=sum(grads.values()),
        master_weights=0,  # the fp32 shards are the masters
        optimizer_states=sum(
            t.numel() * t.element_size() for st in optimizer.state.values() for k, t in st.items() if k != "step"
        ),
    )


def _sharded_params(model: torch.nn.Module) -> list:
    """Every reference.fsdp2 ShardedParam under `model`."""
    states = [m.__dict__.get(STATE_ATTR) for m in model.modules()]
    return [p for st in states if st is not None and st.group is not None for p in st.group.params]


def _grad_buffers(model: torch.nn.Module) -> dict[int, int]:
    """{id: bytes} of the flat buffers the sharded gradients view (one per group and step)."""
    bases = [p.sharded_param.grad for p in _sharded_params(model) if p.sharded_param.grad is not None]
    bases = [g if g._base is None else g._base for g in bases]
    return {id(b): b.numel() * b.element_size() for b in bases}


def _labelled(
    events: list[CollectiveEvent], layout: ParallelLayout, extra: dict | None = None
) -> list[CollectiveEvent]:
    """The events with `module` replaced by the kind of group they ran on (`extra`: {ranks: kind} of groups
    the layout does not hold)."""
    extra = extra or {}
    return [dataclasses.replace(e, module=extra.get(e.group_ranks) or layout.group_kind(e.group_ranks)) for e in events]


def summarize(setup: ScaleSetup, rank: int, events: list[CollectiveEvent]) -> list[Row]:
    """One Row per (group, op) seen or predicted, in group then op order."""
    return rows_of(events, formulas.expected(setup, stage_of(setup, rank), shard_rank_of(setup, rank)), GROUPS)


def rows_of(events: list[CollectiveEvent], predicted: dict, groups: tuple[str, ...]) -> list[Row]:
    """The labelled events counted per (group, op) beside the predicted terms, in `groups` order (others last),
    then op order: summarize() for the dense and the MoE trace."""
    measured: dict[tuple[str, str], list[int]] = {}
    for e in events:
        entry = measured.setdefault((e.module, e.op), [0, 0])
        entry[0] += 1
        entry[1] += e.nbytes
    rows = []
    order = lambda k: (groups.index(k[0]) if k[0] in groups else len(groups), k[1])
    for key in sorted(measured.keys() | predicted.keys(), key=order):
        count, nbytes = measured.get(key, (0, 0))
        terms = predicted.get(key, [])
        f_count, f_bytes = formulas.totals(terms)
        rows.append(Row(*key, count, nbytes, f_count, f_bytes, " + ".join(t.formula for t in terms) or "none"))
    return rows


def simulate(setup: ScaleSetup, rank: int) -> list[Row]:
    """trace_rank, then summarize against the formulas."""
    return summarize(setup, rank, trace_rank(setup, rank))


def default_ranks(setup: ScaleSetup) -> list[int]:
    """TP rank 0 of DP replica 0 on the first, a middle and the last stage (each distinct stage once)."""
    grid = _mesh(setup).grid
    return [int(grid[p, 0, 0]) for p in sorted({0, setup.pp // 2, setup.pp - 1})]


@dataclasses.dataclass(frozen=True)
class RankStep:
    """What one rank did in one training step: the collectives it issued, and the bytes it held after."""

    rank: int
    events: list[CollectiveEvent]
    held: dict[str, int]
    pipeline: dict[str, int] = dataclasses.field(default_factory=dict)


def step_of(setup: ScaleSetup, rank: int, trace=trace_rank) -> RankStep:
    """`trace` (trace_rank, or the MoE one), keeping the bytes held too: what document() reports for `rank`."""
    held: dict[str, int] = {}
    pipeline: dict[str, int] = {}
    events = trace(setup, rank, held=held, **({"pipeline": pipeline} if trace is trace_rank else {}))
    return RankStep(rank, events, held, pipeline)


def document(setup: ScaleSetup, steps: list[RankStep]) -> dict:
    """The JSON a scale trace is stored as (reading_notes/traces/scale_*.json): setup, the whole model's
    parameter count (formulas.parameter_count), and per traced rank its rows and, apart from them, the
    formulas' terms per (group, op): the site's tables read these instead of importing this package (the
    citation tool never imports torch)."""
    runs = []
    for step in steps:
        rank = step.rank
        stage = stage_of(setup, rank)
        runs.append(
            {
                "rank": rank,
                "stage": stage,
                "memory": {"measured": step.held, "formula": formulas.memory(setup, stage, shard_rank_of(setup, rank))},
                **({"pipeline": _pipeline(setup, stage, step.pipeline)} if step.pipeline else {}),
                **rows_document(
                    summarize(setup, rank, step.events), formulas.expected(setup, stage, shard_rank_of(setup, rank))
                ),
            }
        )
    return {
        "kind": "scale",
        "setup": setup.to_dict(),
        "world": setup.world,
        "parameters": formulas.parameter_count(setup.model),
        "runs": runs,
        "agree": agree(runs),
    }


def _pipeline(setup: ScaleSetup, stage: int, measured: dict) -> dict:
    """A traced stage's pipeline figures: its peak in flight beside the formula's, and the schedule's bubble."""
    return {"measured": measured, "formula": formulas.pipeline(setup, stage), "bubble_formula": formulas.bubble(setup)}


def rows_document(rows: list[Row], predicted: dict) -> dict:
    """A traced run's "rows" and, apart from them, "formulas" (the predicted terms per group and op), as a scale
    trace stores them."""
    return {
        "rows": [
            {
                "group": r.group,
                "op": r.op,
                "count": r.count,
                "bytes": r.nbytes,
                "formula_count": r.formula_count,
                "formula_bytes": r.formula_nbytes,
                "formula": r.formula,
            }
            for r in rows
        ],
        "formulas": [
            {"group": group, "op": op, "terms": [dataclasses.asdict(t) for t in terms]}
            for (group, op), terms in predicted.items()
        ],
    }


def rows_table(rows: list[dict], width: int, bytes_width: int) -> list[str]:
    """A run's rows (group, op, count, bytes beside the formula's) as a header and a line each, a row the
    formula does not give marked MISMATCH: the dense and the MoE trace print them so."""
    lines = [f"  {'group':{width}} {'op':14} {'count':>6} {'bytes':>{bytes_width}} {'':>12}  formula"]
    for r in rows:
        ok = r["count"] == r["formula_count"] and r["bytes"] == r["formula_bytes"]
        verdict = "" if ok else f"   MISMATCH: formula gives {r['formula_count']} x, {r['formula_bytes']} B"
        lines.append(
            f"  {r['group']:{width}} {r['op']:14} {r['count']:>6} {r['bytes']:>{bytes_width},} "
            f"{formulas.human(r['bytes']):>12}  {r['formula']}{verdict}"
        )
    return lines


def agree(runs: list[dict]) -> bool:
    """Whether every stored row, and every run's bytes held, equal the formulas'."""
    return all(
        row["count"] == row["formula_count"] and row["bytes"] == row["formula_bytes"]
        for run in runs
        for row in run["rows"]
    ) and all(
        run[what]["measured"] == run[what]["formula"] for run in runs for what in ("memory", "pipeline") if what in run
    )
