"""What the FSDP2 close reading claims, shown on PyTorch FSDP2 (`fully_shard`) itself (torch 2.13.0).

At world 4 on CPU/gloo, the first test to ask builds Net (a root holding an input and an output Linear, and three
residual MLP blocks), applies `fully_shard` to each block and then to the root, and trains two Adam steps, with
fully_shard's defaults (its default mesh: every rank, 1-D) and with each option the note discusses, under one
CollectiveRecorder (`recorded()`, once a rank). Each test asserts on what its rank recorded. Row counts (10, 5,
7, 9 and 3) do not divide by 4 on purpose: every group needs padding, and one rank holds no row of `out.weight`.
Groups in forward order: root (its forward encloses the blocks'), blocks.0-2; in post-forward order the root
comes last.
"""

from __future__ import annotations

import functools
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

from reference.measure.recorder import CollectiveRecorder, current_phase
from study.estimates import training_memory
from tests.ranks import on_ranks
from tests.reference.helpers import every_rank

pytestmark = pytest.mark.upstream("pytorch")

WORLD = 4
STEPS, BATCH, SEED, WIDTH, INPUTS = 2, 4, 7, 10, 6
BLOCKS = ["blocks.0", "blocks.1", "blocks.2"]
GROUPS = ["root", *BLOCKS]  # forward order
FORWARD_PAIRS = list(zip(GROUPS, GROUPS[1:]))  # (group, the next to run forward)
BACKWARD_PAIRS = [("root", "blocks.2"), ("blocks.2", "blocks.1"), ("blocks.1", "blocks.0")]  # reverse post-forward
BF16 = torch.bfloat16
CONFIGS = {  # name -> (options of every fully_shard call, options of the blocks' calls only)
    "default": ({}, {}),
    "explicit_prefetch": ({}, {}),  # prefetch lists set after wrapping (build)
    "keep_after_forward": ({}, {"reshard_after_forward": False}),
    "reshard_to_2": ({}, {"reshard_after_forward": 2}),
    "bf16": ({"mp_policy": MixedPrecisionPolicy(param_dtype=BF16)}, {}),
    "bf16_fp32_reduce": ({"mp_policy": MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)}, {}),
    "hsdp": ({}, {}),  # mesh: 2 replicas x 2 shards (build)
}


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, hidden), nn.Linear(hidden, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(INPUTS, WIDTH)
        self.blocks = nn.ModuleList(Block(hidden) for hidden in (5, 7, 9))
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build(config: str) -> Net:
    """Net with fully_shard on each block, then on the root, under `config`."""
    torch.manual_seed(SEED)
    model = Net()
    common, blocks_only = CONFIGS[config]
    if config == "hsdp":
        common = {"mesh": init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("replicate", "shard"))}
    for block in model.blocks:
        fully_shard(block, **common, **blocks_only)
    fully_shard(model, **common)
    if config == "explicit_prefetch":
        model.set_modules_to_forward_prefetch([model.blocks[0]])
        for current, following in zip(model.blocks, model.blocks[1:]):
            current.set_modules_to_forward_prefetch([following])
        model.blocks[2].set_modules_to_backward_prefetch([model.blocks[1], model.blocks[0]])
    return model


def gathered_numel(shape: list[int], shard_size: int) -> int:
    """What the note claims one parameter adds to its group's all-gather: dim 0 padded to a multiple of the
    shard group's size."""
    return math.ceil(shape[0] / shard_size) * shard_size * math.prod(shape[1:])


def instrument(model: Net, recorder: CollectiveRecorder) -> dict:
    """Each group's collectives attributed to it (its unshard and post-backward run inside recorder scopes named
    for it); spans "<group> pre-forward" (fully_shard's forward pre-hook, with its explicit prefetches) and
    "<group> pre-backward" (FSDPState._pre_backward, looked up each forward when it is registered on the outputs).
    Returns the parameter groups by name."""
    groups = {}
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        name = name or "root"
        state = module._get_fsdp_state()
        (group,) = state._fsdp_param_groups
        groups[name] = group
        group.unshard = scoped(group.unshard, name, recorder)
        group.post_backward = scoped(group.post_backward, name, recorder)
        state._pre_backward = scoped(state._pre_backward, name, recorder, span=f"{name} pre-backward")
        started: dict = {}

        def before(_module, _args, started=started):
            started["t"] = time.perf_counter()

        def after(_module, _args, name=name, started=started):
            recorder.add_span(f"{name} pre-forward", current_phase(), started["t"], time.perf_counter())

        module.register_forward_pre_hook(before, prepend=True)  # runs before fully_shard's pre-hook, `after` after it
        module.register_forward_pre_hook(after)
    return groups


def scoped(method, name: str, recorder: CollectiveRecorder, span: str | None = None):
    def wrapped(*args, **kwargs):
        start = time.perf_counter()
        with recorder.scope(name):
            result = method(*args, **kwargs)
        if span:
            recorder.add_span(span, current_phase(), start, time.perf_counter())
        return result

    return wrapped


def describe(p: torch.Tensor) -> dict:
    """A registered parameter: its type, shape, dtype; for a DTensor its placements, mesh and local shape."""
    out = {"type": type(p).__name__, "shape": list(p.shape), "dtype": str(p.dtype).removeprefix("torch.")}
    if isinstance(p, DTensor):
        local = p.to_local()
        out.update(placements=tuple(p.placements), mesh=list(p.device_mesh.shape), local=list(local.shape))
    return out


def local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def run_config(config: str, recorder: CollectiveRecorder, rank: int) -> dict:
    """One configuration: its shards before training (and, 1-D, whether they re-assemble the unsharded
    parameters), then per step the events (op, group, ranks, bytes, dtype, phase, issue time, tensors) and spans;
    blocks.0's parameters as its forward sees them; each group's registered parameters once the root's forward
    has returned; the gradients; and this rank's bytes of parameters, gradients and Adam states."""
    model = build(config)
    torch.manual_seed(SEED)
    original = dict(Net().named_parameters())
    mesh = next(model.parameters()).device_mesh
    shard_size = mesh.size(mesh.ndim - 1)
    groups = instrument(model, recorder)
    fsdp_params = {id(fp.sharded_param): fp for g in groups.values() for fp in g.fsdp_params}
    shards = {}
    for name, p in model.named_parameters():
        shards[name] = {**describe(p), "padded": list(fsdp_params[id(p)].padded_sharded_param_size)}
        if mesh.ndim == 1:
            shards[name]["reassembles"] = torch.equal(p.full_tensor(), original[name])
    names = {id(p): name for name, p in model.named_parameters()}
    gathered = {
        name: sum(gathered_numel(list(original[names[id(fp.sharded_param)]].shape), shard_size) for fp in g.fsdp_params)
        for name, g in groups.items()
    }
    seen: dict = {}

    def peek(module, _args):  # after fully_shard's pre-forward: blocks.0's parameters as its forward sees them
        seen.setdefault(
            "in_forward", [{**describe(p), "storage": p.untyped_storage().data_ptr()} for p in module.parameters()]
        )

    model.blocks[0].register_forward_pre_hook(peek)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(SEED + rank)
    steps, after_forward, memory = [], None, None
    for _ in range(STEPS):
        recorder.clear()
        out = model(torch.randn(BATCH, INPUTS, generator=data))
        if after_forward is None:
            after_forward = {
                name: [
                    describe(getattr(fp._module_info.module, fp._module_info.param_name)) for fp in group.fsdp_params
                ]
                for name, group in groups.items()
            }
        out.sum().backward()
        steps.append(
            {
                "events": [
                    {
                        "op": e.op,
                        "group": e.module,
                        "ranks": e.group_ranks,
                        "nbytes": e.nbytes,
                        "dtype": e.dtype,
                        "phase": e.phase,
                        "start": e.start,
                        "num_tensors": e.num_tensors,
                    }
                    for e in recorder.events
                ],
                "spans": [(s.name, s.start, s.end) for s in recorder.spans],
                "grads": [describe(p.grad) for p in model.parameters()],
            }
        )
        optimizer.step()
        memory = {
            "params": sum(local_bytes(p) for p in model.parameters()),
            "grads": sum(local_bytes(p.grad) for p in model.parameters()),
            "optimizer": sum(local_bytes(s[k]) for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")),
        }
        optimizer.zero_grad()
    return {
        "steps": steps,
        "shards": shards,
        "gathered_numel": gathered,
        "in_forward": seen["in_forward"],
        "after_forward": after_forward,
        "memory": memory,
        "params": sum(p.numel() for p in original.values()),
        "shard_group": dist.get_process_group_ranks(mesh.get_group(mesh.ndim - 1)),
        "replicate_group": dist.get_process_group_ranks(mesh.get_group(0)) if mesh.ndim == 2 else None,
    }


@functools.cache
def recorded() -> dict:
    """This rank's recordings of every configuration."""
    rank = dist.get_rank()
    with CollectiveRecorder() as recorder:
        return {"rank": rank, "runs": {config: run_config(config, recorder, rank) for config in CONFIGS}}


def steps(config: str):
    yield from recorded()["runs"][config]["steps"]


def issued(step: dict, op: str, group: str, phase: str) -> float:
    starts = [e["start"] for e in step["events"] if (e["op"], e["group"], e["phase"]) == (op, group, phase)]
    assert len(starts) == 1, f"expected one {phase} {op} of {group}, found {len(starts)}"
    return starts[0]


def inside(step: dict, time: float, span: str) -> bool:
    return any(name == span and start <= time <= end for name, start, end in step["spans"])


@on_ranks(WORLD)
def test_each_parameter_becomes_a_dim0_shard_padded_to_equal_chunks(ranks):
    """Default mesh: every parameter is a DTensor placed Shard(0) on all ranks; rank r holds the r-th chunk of
    its rows (fewer, or none, on the last ranks), kept in a zero-padded buffer of ceil(rows / N) rows; the
    ranks' shards re-assemble the unsharded parameter."""
    by_rank = every_rank(recorded()["runs"]["default"]["shards"])
    for name, mine in by_rank[0].items():
        rows, rest = mine["shape"][0], mine["shape"][1:]
        padded = [math.ceil(rows / WORLD), *rest]
        for shards in by_rank:
            shard = shards[name]
            assert (shard["type"], shard["placements"], shard["mesh"]) == ("DTensor", (Shard(0),), [WORLD])
            assert shard["padded"] == padded and shard["local"][1:] == rest and shard["local"][0] <= padded[0]
            assert shard["reassembles"]
        assert sum(shards[name]["local"][0] for shards in by_rank) == rows
    assert [shards["out.weight"]["local"][0] for shards in by_rank][-1] == 0  # 3 rows on 4 ranks


@on_ranks(WORLD)
def test_one_all_gather_per_group_of_all_its_padded_shards_copied_out_per_parameter(ranks):
    """Forward, every step: one all-gather per group, of one flat tensor holding every parameter's padded shard
    (N x the padded shards' elements, fp32); the forward then sees each parameter as its own plain Parameter of
    the original shape, with its own storage: copied out, not views into the gathered buffer."""
    run = recorded()["runs"]["default"]
    for step in run["steps"]:
        forward = [
            (e["group"], e["op"], e["nbytes"], e["num_tensors"]) for e in step["events"] if e["phase"] == "forward"
        ]
        assert forward == [(group, "all_gather", run["gathered_numel"][group] * 4, 1) for group in GROUPS]
    unsharded = run["in_forward"]
    shapes = [run["shards"][f"blocks.0.{n}"]["shape"] for n in ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")]
    assert [(p["type"], p["shape"]) for p in unsharded] == [("Parameter", shape) for shape in shapes]
    assert len({p["storage"] for p in unsharded}) == len(unsharded)


@on_ranks(WORLD)
def test_default_gathers_each_group_in_its_own_pre_forward_and_the_previous_one_from_pre_backward(ranks):
    """Defaults: in forward each group's all-gather comes from its own pre-forward hook (no forward prefetch);
    in backward a group's pre-backward all-gathers the group whose forward ended before its own (reverse
    post-forward order: the root's gathers blocks.2), before its own reduce-scatter."""
    for step in steps("default"):
        for group in GROUPS:
            assert inside(step, issued(step, "all_gather", group, "forward"), f"{group} pre-forward")
        for current, previous in BACKWARD_PAIRS:
            gather = issued(step, "all_gather", previous, "backward")
            assert inside(step, gather, f"{current} pre-backward")
            if current != "root":
                assert not inside(step, gather, f"{previous} pre-backward")
                assert gather < issued(step, "reduce_scatter", current, "backward")


@on_ranks(WORLD)
def test_explicit_prefetch_gathers_the_listed_groups_from_the_current_hook(ranks):
    """set_modules_to_forward_prefetch([next]): a group's pre-forward issues the next group's all-gather right
    after its own; set_modules_to_backward_prefetch([blocks.1, blocks.0]) on blocks.2: its pre-backward issues
    both, before its reduce-scatter (the default gathers one group ahead)."""
    for step in steps("explicit_prefetch"):
        for current, following in FORWARD_PAIRS:
            gather = issued(step, "all_gather", following, "forward")
            assert inside(step, gather, f"{current} pre-forward")
            assert issued(step, "all_gather", current, "forward") < gather
        for previous in ("blocks.1", "blocks.0"):
            gather = issued(step, "all_gather", previous, "backward")
            assert inside(step, gather, "blocks.2 pre-backward")
            assert gather < issued(step, "reduce_scatter", "blocks.2", "backward")
    for step in steps("default"):
        assert not inside(step, issued(step, "all_gather", "blocks.0", "backward"), "blocks.2 pre-backward")


def backward_gathers(step: dict) -> list[tuple[str, int]]:
    return sorted(
        (e["group"], len(e["ranks"])) for e in step["events"] if (e["op"], e["phase"]) == ("all_gather", "backward")
    )


@on_ranks(WORLD)
def test_reshard_after_forward_default_frees_every_group_but_the_root(ranks):
    """reshard_after_forward=None: after forward each block's registered parameters are its sharded DTensors
    again and are re-gathered in backward; the root (lazy init sets it False) keeps its unsharded Parameters
    and is not gathered again."""
    run = recorded()["runs"]["default"]
    assert {p["type"] for p in run["after_forward"]["root"]} == {"Parameter"}
    for block in BLOCKS:
        assert {p["type"] for p in run["after_forward"][block]} == {"DTensor"}
    for step in run["steps"]:
        assert backward_gathers(step) == [(block, WORLD) for block in BLOCKS]


@on_ranks(WORLD)
def test_reshard_after_forward_false_keeps_parameters_and_skips_the_backward_all_gathers(ranks):
    run = recorded()["runs"]["keep_after_forward"]
    assert all(p["type"] == "Parameter" for group in run["after_forward"].values() for p in group)
    for step in run["steps"]:
        assert backward_gathers(step) == []


@on_ranks(WORLD)
def test_reshard_after_forward_int_keeps_a_larger_shard_and_gathers_it_over_the_smaller_group(ranks):
    """reshard_after_forward=2 at world 4: after forward each block parameter is a DTensor on a 2 x 2 mesh,
    every row held by one rank of each pair (twice in all, against once after the forward all-gather of 4);
    backward re-gathers it within the pair: the same bytes over 2 ranks."""
    run = recorded()["runs"]["reshard_to_2"]
    by_rank = every_rank(run["after_forward"])
    for block in BLOCKS:
        for index, p in enumerate(run["after_forward"][block]):
            assert (p["type"], p["mesh"]) == ("DTensor", [WORLD // 2, 2])
            assert sum(r[block][index]["local"][0] for r in by_rank) == 2 * p["shape"][0]
    for step in run["steps"]:
        forward = [(e["group"], len(e["ranks"])) for e in step["events"] if e["phase"] == "forward"]
        assert forward == [(group, WORLD) for group in GROUPS]
        assert backward_gathers(step) == [(block, 2) for block in BLOCKS]
        for e in step["events"]:
            if e["op"] == "all_gather":
                assert e["nbytes"] == run["gathered_numel"][e["group"]] * 4


@on_ranks(WORLD)
def test_mixed_precision_gathers_in_param_dtype_reduces_in_reduce_dtype_and_keeps_fp32_shards(ranks):
    """MixedPrecisionPolicy: one reduce-scatter per group per step, of the gathered size; the default policy
    (param_dtype=None, reduce_dtype=None) gathers and reduces fp32; param_dtype=bf16 gathers and computes in
    bf16 and, with reduce_dtype=None, reduce-scatters bf16; reduce_dtype=fp32 reduce-scatters fp32. Shards and
    their gradients stay fp32 DTensors."""
    dtypes = {
        "default": ("float32", "float32"),
        "bf16": ("bfloat16", "bfloat16"),
        "bf16_fp32_reduce": ("bfloat16", "float32"),
    }
    for config, (gather, reduce) in dtypes.items():
        run = recorded()["runs"][config]
        for step in run["steps"]:
            assert sorted(e["group"] for e in step["events"] if e["op"] == "reduce_scatter") == sorted(GROUPS)
            for e in step["events"]:
                dtype = gather if e["op"] == "all_gather" else reduce
                size = torch.finfo(getattr(torch, dtype)).bits // 8
                assert (e["dtype"], e["nbytes"]) == (dtype, run["gathered_numel"][e["group"]] * size)
            assert {(g["type"], g["dtype"]) for g in step["grads"]} == {("DTensor", "float32")}
        assert {p["dtype"] for p in run["in_forward"]} == {gather}
        assert {p["dtype"] for p in run["shards"].values()} == {"float32"}


@on_ranks(WORLD)
def test_hsdp_reduce_scatters_within_the_shard_group_then_all_reduces_across_replicas(ranks):
    """A 2 x 2 mesh (replicate, shard): parameters placed (Replicate(), Shard(0)), padded to the shard group's
    2; all-gathers within the shard group; per group in backward, a reduce-scatter within the shard group, then an
    all-reduce of its output (half the bytes) across the replicas."""
    run = recorded()["runs"]["hsdp"]
    shard, replicate = tuple(run["shard_group"]), tuple(run["replicate_group"])
    assert len(shard) == len(replicate) == 2 and set(shard) & set(replicate) == {ranks.rank}
    for p in run["shards"].values():
        assert p["placements"] == (Replicate(), Shard(0)) and p["padded"][0] == math.ceil(p["shape"][0] / 2)
    for step in run["steps"]:
        assert {e["ranks"] for e in step["events"] if e["op"] == "all_gather"} == {shard}
        for group in GROUPS:
            full = run["gathered_numel"][group] * 4
            reductions = [
                (e["op"], e["ranks"], e["nbytes"])
                for e in step["events"]
                if e["group"] == group and e["op"] != "all_gather"
            ]
            assert reductions == [("reduce_scatter", shard, full), ("all_reduce", replicate, full // len(shard))]


@on_ranks(WORLD)
def test_hsdp_per_rank_training_bytes_follow_the_shard_group_not_the_world(ranks):
    """After an Adam step, the ranks of one shard group hold each parameter, its gradient and both Adam moments
    exactly once (the connect-the-dots formula, study.estimates.training_memory, on the whole model):
    4 ranks each holding about a quarter under the 1-D default, 2 ranks each holding about a half under HSDP,
    whatever the number of replicas."""
    for config in ("default", "hsdp"):
        run = recorded()["runs"][config]
        whole = training_memory(run["params"], world=1, sharded=False)
        by_rank = every_rank(run["memory"])
        held = {part: sum(by_rank[r][part] for r in run["shard_group"]) for part in ("params", "grads", "optimizer")}
        assert held == {"params": whole.params, "grads": whole.grads, "optimizer": whole.optimizer}
        assert len(run["shard_group"]) == (WORLD if config == "default" else 2)
