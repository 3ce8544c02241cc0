"""The FSDP1 ↔ FSDP2 page's rows, each shown on PyTorch's FSDP1 and FSDP2 themselves (torch 2.13.0), and on the
reference where it mirrors them.

At world 4 on CPU/gloo, the first test to ask runs tools/fsdp_compare.py's `record()` (the run behind the committed
trace reading_notes/traces/fsdp1_vs_fsdp2.json, which the page renders): the small GPT (two layers, rows of 101,
16, 27, 81 and 108 that 4 does not all divide) under FSDP1 (`FullyShardedDataParallel` on each layer, then the
root) and FSDP2 (`fully_shard` on each layer, then the root), with their defaults and with each option the page
discusses, two Adam steps each, then each one's parameters and state_dict. `record_reference()` runs the
reference FSDP1 (reference.fsdp, which behaves as `use_orig_params=True`) and FSDP2 (reference.fsdp2) on the same
runs. Each test asserts on what this rank's runs did; the first also that the committed trace is that run.
Units in forward order: root (embedding, position table, final LayerNorm, output layer), layers.0, layers.1.
"""

from __future__ import annotations

import functools
import json
import math

import fsdp_compare  # tools/: the recording behind the committed trace
import pytest
import torch

from tests.launch import ROOT
from tests.ranks import on_ranks

pytestmark = pytest.mark.upstream("pytorch")

WORLD = fsdp_compare.WORLD
UNITS = fsdp_compare.UNITS
LAYERS = UNITS[1:]
TRACE = ROOT / "reading_notes" / "traces" / "fsdp1_vs_fsdp2.json"
FLOAT = 4


@functools.cache
def recorded() -> dict:
    return fsdp_compare.record()


@functools.cache
def reference() -> dict:
    return fsdp_compare.record_reference()


def runs(name: str) -> dict:
    return recorded()["runs"][name]


def collectives(name: str, step: int = -1, *keys: str) -> list[tuple]:
    keys = keys or ("phase", "op", "unit", "nbytes", "ranks", "prefetch")
    return [tuple(c[k] for k in keys) for c in runs(name)["steps"][step]["collectives"]]


def issued_in(name: str, step: int, op: str, unit: str, phase: str) -> str:
    found = [
        c["issued_in"]
        for c in runs(name)["steps"][step]["collectives"]
        if (c["op"], c["unit"], c["phase"]) == (op, unit, phase)
    ]
    assert len(found) == 1, f"{name}: expected one {phase} {op} of {unit}, found {len(found)}"
    return found[0]


def params_of(unit: str) -> list[dict]:
    return [p for p in recorded()["parameters"] if p["unit"] == unit]


def numel(shape: list[int]) -> int:
    return math.prod(shape)


@pytest.mark.freshness
@on_ranks(WORLD)
def test_the_committed_trace_is_what_fsdp1_and_fsdp2_do_now(ranks):
    """The page's numbers are this run's: tools/record-traces wrote the same trace (losses aside, which the
    same run computes equal under both: same model, same data, same steps)."""
    committed = json.loads(TRACE.read_text())
    assert fsdp_compare.trace_of(recorded()) == committed, (
        "reading_notes/traces/fsdp1_vs_fsdp2.json is stale: re-record with tools/record-traces --only fsdp1_vs_fsdp2"
    )
    losses = {name: [s["loss"] for s in run["steps"]] for name, run in recorded()["runs"].items()}
    for name, each in losses.items():  # every rank's, step by step
        assert each == [pytest.approx(step, rel=1e-6) for step in losses["fsdp1"]], name


@on_ranks(WORLD)
def test_fsdp1_pads_each_units_flat_parameter_to_a_multiple_of_the_world(ranks):
    """FSDP1 (use_orig_params=False, its default): a unit's parameters, concatenated, are one flat parameter
    padded to a multiple of N (fewer than N elements of padding per unit); every rank holds a shard of
    padded / N elements, the same size on every rank, and so its gradient and Adam's moments."""
    layout = runs("fsdp1")["layout"]
    assert sorted(layout) == sorted(UNITS)
    for unit in UNITS:
        flat = layout[unit]
        assert flat["numel"] == sum(numel(p["shape"]) for p in params_of(unit))
        assert flat["padded_numel"] == math.ceil(flat["numel"] / WORLD) * WORLD
        assert flat["shard_numel"] * WORLD == flat["padded_numel"]
        assert flat["params"] == len(params_of(unit))
    shard = sum(flat["shard_numel"] for flat in layout.values())
    for held in runs("fsdp1")["held"]:
        assert held == {"params": FLOAT * shard, "grads": FLOAT * shard, "optimizer": 2 * FLOAT * shard}


@on_ranks(WORLD)
def test_fsdp1_use_orig_params_aligns_each_original_to_16_bytes_before_padding(ranks):
    """use_orig_params=True: each original parameter starts at a multiple of 16 bytes inside the flat parameter
    (alignment padding between them), then the whole is padded to a multiple of N (flattened in with it); Adam's
    moments follow the original parameters' views, so they hold no padding and differ by rank, totalling 8 bytes
    per parameter."""
    layout = runs("fsdp1_use_orig_params")["layout"]
    for unit in UNITS:
        offset = 0
        for p in params_of(unit):
            offset += -offset % (16 // FLOAT)
            offset += numel(p["shape"])
        # with alignment on, FSDP1 flattens the padding to N in as one more padding tensor
        assert layout[unit]["numel"] == layout[unit]["padded_numel"] == math.ceil(offset / WORLD) * WORLD
    shard = sum(flat["shard_numel"] for flat in layout.values())
    held = runs("fsdp1_use_orig_params")["held"]
    assert all((h["params"], h["grads"]) == (FLOAT * shard, FLOAT * shard) for h in held)
    total = sum(numel(p["shape"]) for p in recorded()["parameters"])
    assert sum(h["optimizer"] for h in held) == 2 * FLOAT * total


@on_ranks(WORLD)
def test_fsdp2_pads_each_parameter_to_a_multiple_of_the_world_in_rows(ranks):
    """FSDP2: each parameter is cut on dim 0 as torch.chunk cuts it (ceil(rows / N) rows a rank, the last ranks
    fewer), every rank keeping a buffer of ceil(rows / N) rows: padding of up to N - 1 rows per parameter. The
    parameter and gradient buffers are the padded ones on every rank; Adam's moments follow the DTensors' local
    rows, so they hold no padding and differ by rank."""
    layout = runs("fsdp2")["layout"]
    padded = 0
    for p in recorded()["parameters"]:
        rows, rest = p["shape"][0], p["shape"][1:]
        entry = layout[p["name"]]
        assert entry["padded_shard"] == [math.ceil(rows / WORLD), *rest]
        assert [local[0] for local in entry["local"]] == [len(c) for c in torch.arange(rows).chunk(WORLD)] + [0] * (
            WORLD - len(torch.arange(rows).chunk(WORLD))
        )
        padded += numel(entry["padded_shard"])
    held = runs("fsdp2")["held"]
    assert all((h["params"], h["grads"]) == (FLOAT * padded, FLOAT * padded) for h in held)
    for rank, h in enumerate(held):
        assert h["optimizer"] == 2 * FLOAT * sum(numel(e["local"][rank]) for e in layout.values())
    fsdp1 = sum(flat["shard_numel"] for flat in runs("fsdp1")["layout"].values())
    assert padded > fsdp1  # per-parameter rows pad more than one flat parameter per unit


@on_ranks(WORLD)
def test_both_issue_one_all_gather_per_unit_and_pass_and_one_reduce_scatter_per_unit(ranks):
    """Per step, under both: an all-gather of each unit in forward, of each layer again in backward (the root
    keeps its parameters), and one reduce-scatter of each unit; each of N times the unit's shard: FSDP1 its
    padded flat parameter, FSDP2 the sum of its parameters' padded shards (one flat buffer per group)."""
    flat = runs("fsdp1")["layout"]
    per_param = runs("fsdp2")["layout"]
    group = {unit: sum(numel(per_param[p["name"]]["padded_shard"]) for p in params_of(unit)) for unit in UNITS}
    sizes = {
        "fsdp1": {u: FLOAT * flat[u]["padded_numel"] for u in UNITS},
        "fsdp2": {u: FLOAT * WORLD * group[u] for u in UNITS},
    }
    for name, size in sizes.items():
        for step in range(len(runs(name)["steps"])):
            assert sorted(collectives(name, step, "phase", "op", "unit", "nbytes", "ranks")) == sorted(
                [("forward", "all_gather", u, size[u], WORLD) for u in UNITS]
                + [("backward", "all_gather", u, size[u], WORLD) for u in LAYERS]
                + [("backward", "reduce_scatter", u, size[u], WORLD) for u in UNITS]
            )


@on_ranks(WORLD)
def test_fsdp1_parameters_are_one_flat_parameter_per_unit(ranks):
    """FSDP1's default: named_parameters() yields one FlatParameter per unit, 1-D, of padded / N elements on
    every rank; with use_orig_params=True the original names, each a 1-D view of the part of it in this rank's
    shard (size 0 where none is)."""
    described = recorded()["state_dicts"]
    flat = described["fsdp1_parameters"]["entries"]
    layout = runs("fsdp1")["layout"]
    assert flat == {
        ("_flat_param" if u == "root" else f"{u}._flat_param"): {
            "type": "FlatParameter",
            "shape": [layout[u]["shard_numel"]],
            "dtype": "float32",
            "local": [[layout[u]["shard_numel"]]] * WORLD,
        }
        for u in UNITS
    }
    views = described["fsdp1_use_orig_params_parameters"]["entries"]
    assert list(views) == [p["name"] for p in recorded()["parameters"]]
    for p in recorded()["parameters"]:
        entry = views[p["name"]]
        assert entry["type"] == "Parameter" and all(len(local) == 1 for local in entry["local"])
        assert sum(local[0] for local in entry["local"]) == numel(p["shape"])
    assert any([0] in entry["local"] for entry in views.values())


@on_ranks(WORLD)
def test_fsdp1_state_dict_all_gathers_every_unit_full_or_rechunked_by_rows(ranks):
    """FSDP1's state_dict() (FULL_STATE_DICT, its default) all-gathers each unit's flat parameter and returns
    every original parameter whole, a plain Tensor, on every rank; SHARDED_STATE_DICT all-gathers the same and
    returns ShardedTensors chunked on dim 0 by rows (torch.chunk), the very rows an FSDP2 rank holds."""
    described = recorded()["state_dicts"]
    flat = runs("fsdp1")["layout"]
    gathers = [{"op": "all_gather", "nbytes": FLOAT * flat[u]["padded_numel"]} for u in UNITS]
    full, sharded = described["fsdp1_full_state_dict"], described["fsdp1_sharded_state_dict"]
    fsdp2 = described["fsdp2_state_dict"]["entries"]
    assert full["collectives"] == gathers and sharded["collectives"] == gathers
    for p in recorded()["parameters"]:
        assert full["entries"][p["name"]] == {
            "type": "Tensor",
            "shape": p["shape"],
            "dtype": "float32",
            "local": [p["shape"]] * WORLD,
        }
        entry = sharded["entries"][p["name"]]
        assert (entry["type"], entry["shape"], entry["placement"]) == (
            "ShardedTensor",
            p["shape"],
            ["ChunkShardingSpec(dim=0)"],
        )
        assert entry["local"] == fsdp2[p["name"]]["local"]


@on_ranks(WORLD)
def test_fsdp2_state_dict_is_its_dtensor_parameters_with_no_collective(ranks):
    """FSDP2's parameters are DTensors placed Shard(0) of the original names and shapes, each rank's local tensor
    its own rows; state_dict() returns them detached (nn.Module stores param.detach() unless keep_vars), sharing
    the parameters' storage, and issues no collective."""
    described = recorded()["state_dicts"]
    params, state = described["fsdp2_parameters"], described["fsdp2_state_dict"]
    assert state["collectives"] == [] and params["collectives"] == []
    assert params["entries"] == state["entries"]
    for p in recorded()["parameters"]:
        entry = state["entries"][p["name"]]
        assert (entry["type"], entry["shape"], entry["placement"]) == ("DTensor", p["shape"], ["S(0)"])
        assert entry["local"] == runs("fsdp2")["layout"][p["name"]]["local"]
    from torch.distributed.fsdp import fully_shard  # after the recording, which must not see this module

    model = fully_shard(torch.nn.Linear(8, 8))
    state = model.state_dict()
    for name, param in model.named_parameters():
        assert state[name] is not param and not state[name].requires_grad and param.requires_grad
        assert state[name].to_local().untyped_storage().data_ptr() == param.to_local().untyped_storage().data_ptr()


@on_ranks(WORLD)
def test_forward_prefetch_fsdp1_from_its_second_step_fsdp2_explicitly_from_the_first(ranks):
    """By default both all-gather each unit in its own pre-forward. FSDP1's forward_prefetch=True issues the
    next unit's all-gather from the current unit's pre-forward from the second step on (the first records the
    order); FSDP2's set_modules_to_forward_prefetch([next]) does so from the first step."""
    pairs = list(zip(UNITS, LAYERS))  # (unit, the next to run forward)
    for name in ("fsdp1", "fsdp2"):
        for step in (0, 1):
            for unit in UNITS:
                assert issued_in(name, step, "all_gather", unit, "forward") == f"{unit} pre-forward"
    for current, following in pairs:
        assert issued_in("fsdp1_forward_prefetch", 0, "all_gather", following, "forward") == f"{following} pre-forward"
        assert issued_in("fsdp1_forward_prefetch", 1, "all_gather", following, "forward") == f"{current} pre-forward"
        for step in (0, 1):
            assert (
                issued_in("fsdp2_forward_prefetch", step, "all_gather", following, "forward")
                == f"{current} pre-forward"
            )


@on_ranks(WORLD)
def test_default_backward_prefetch_is_the_same_in_both(ranks):
    """FSDP1's default backward_prefetch=BACKWARD_PRE and FSDP2's implicit prefetch: each unit's pre-backward
    all-gathers the layer that ran forward just before it (the root's gathers layers.1, layers.1's gathers
    layers.0), before its own gradient is computed."""
    for name in ("fsdp1", "fsdp2"):
        for step in (0, 1):
            assert issued_in(name, step, "all_gather", "layers.1", "backward") == "root pre-backward"
            assert issued_in(name, step, "all_gather", "layers.0", "backward") == "layers.1 pre-backward"
            assert collectives(name, step, "phase", "op", "unit")[3:5] == [
                ("backward", "all_gather", "layers.1"),
                ("backward", "all_gather", "layers.0"),
            ]


@on_ranks(WORLD)
def test_fsdp1_backward_post_and_none_move_the_backward_all_gather(ranks):
    """BACKWARD_POST: layers.0's all-gather is issued from layers.1's post-backward (after its gradient, before
    its reduce-scatter), and nothing prefetches layers.1 (gathered in its own pre-backward); None: each layer
    gathers in its own pre-backward, layers.0's after layers.1's reduce-scatter."""
    for step in (0, 1):
        assert issued_in("fsdp1_backward_post", step, "all_gather", "layers.1", "backward") == "layers.1 pre-backward"
        assert issued_in("fsdp1_backward_post", step, "all_gather", "layers.0", "backward") == "layers.1 post-backward"
        for layer in LAYERS:
            assert issued_in("fsdp1_backward_none", step, "all_gather", layer, "backward") == f"{layer} pre-backward"
        order = collectives("fsdp1_backward_none", step, "phase", "op", "unit")
        assert order.index(("backward", "reduce_scatter", "layers.1")) < order.index(
            ("backward", "all_gather", "layers.0")
        )


@on_ranks(WORLD)
def test_fsdp2_explicit_backward_prefetch_issues_the_listed_groups_from_one_hook(ranks):
    """set_modules_to_backward_prefetch([layers.1, layers.0]) on the root: the root's pre-backward issues both
    layers' all-gathers (by default layers.0's waits for layers.1's pre-backward)."""
    for step in (0, 1):
        for layer in LAYERS:
            assert issued_in("fsdp2_backward_prefetch", step, "all_gather", layer, "backward") == "root pre-backward"


@on_ranks(WORLD)
def test_fsdp1_rate_limiter_waits_in_unshard_and_fsdp2_has_no_limit_all_gathers(ranks):
    """FSDP1's limit_all_gathers=True (default): `_unshard` took a freed all-gather's event to wait on in every
    step; with False, never. FSDP2's fully_shard has no such option; its streams wait on the previous
    all-gather's copy-out instead, keeping at most that buffer under implicit prefetch, and each listed group's
    under an explicit forward list."""
    import inspect

    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

    assert all(step["limiter_waits"] > 0 for step in runs("fsdp1")["steps"])
    assert all(step["limiter_waits"] == 0 for step in runs("fsdp1_no_limit_all_gathers")["steps"])
    assert inspect.signature(FullyShardedDataParallel).parameters["limit_all_gathers"].default is True
    assert "limit_all_gathers" not in inspect.signature(fully_shard).parameters
    # what bounds FSDP2's gathered buffers instead: implicitly, in blocks[0]'s forward, only its own all-gather
    # buffer is kept (for the next copy-out to overlap) and no later block is gathered yet; an explicit forward
    # list of two leaves both listed blocks' all-gather results pending until each one's own wait
    assert pending_all_gathers_in_first_block_forward(explicit=False) == ([False, False, False], True)
    assert pending_all_gathers_in_first_block_forward(explicit=True) == ([False, True, True], True)


def pending_all_gathers_in_first_block_forward(explicit: bool) -> tuple[list[bool], bool]:
    """Three fully_shard blocks and a root; at the start of blocks[0]'s forward (after FSDP2's own pre-forward):
    which blocks hold an all-gather result not yet waited on, and whether the previous all-gather's buffer is
    kept for the implicit overlap."""
    from torch.distributed.fsdp import fully_shard

    blocks = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(3)))
    for block in blocks:
        fully_shard(block)
    fully_shard(blocks)
    if explicit:
        blocks[0].set_modules_to_forward_prefetch([blocks[1], blocks[2]])
    groups = [block._get_fsdp_state()._fsdp_param_group for block in blocks]
    seen = []
    blocks[0].register_forward_pre_hook(
        lambda *_: seen.append(
            ([g._all_gather_result is not None for g in groups], groups[0].comm_ctx.all_gather_state is not None)
        )
    )
    blocks(torch.randn(2, 8))
    return seen[0]


@on_ranks(WORLD)
def test_keeping_parameters_after_forward_drops_the_backward_all_gathers(ranks):
    """FSDP1's sharding_strategy=SHARD_GRAD_OP and FSDP2's reshard_after_forward=False keep every unit's
    parameters from forward to backward: no all-gather in backward; reshard_after_forward=2 (every call, the
    root's too) keeps a shard over pairs of ranks, and backward all-gathers every unit within its pair, the same
    bytes over 2 ranks."""
    for name in ("fsdp1_shard_grad_op", "fsdp2_reshard_after_forward_false"):
        for step in (0, 1):
            assert [c for c in collectives(name, step, "phase", "op") if c == ("backward", "all_gather")] == []
    default = {c[2]: c[3] for c in collectives("fsdp2") if c[:2] == ("forward", "all_gather")}
    for step in (0, 1):
        backward = [
            c for c in collectives("fsdp2_reshard_after_forward_2", step) if c[:2] == ("backward", "all_gather")
        ]
        assert sorted((c[2], c[3], c[4]) for c in backward) == sorted((u, default[u], 2) for u in UNITS)


@on_ranks(WORLD)
def test_the_reference_holds_and_moves_what_torch_does(ranks):
    """The reference FSDP1 (as use_orig_params=True) and FSDP2, on the same runs: the same bytes per rank of
    parameters, gradients and Adam moments, and the same collectives (pass, op, unit, bytes, group size,
    prefetched or not) step by step; the reference FSDP1's prefetch runs against torch's of the same option
    (use_orig_params=False there, so without bytes)."""
    ours = reference()
    for name, run in ours.items():
        keys = ("phase", "op", "unit", "nbytes", "ranks", "prefetch")
        if name.startswith("fsdp1_") and name != "fsdp1_use_orig_params":
            keys = ("phase", "op", "unit", "ranks", "prefetch")
        for step, mine in enumerate(run["steps"]):
            assert [tuple(c[k] for k in keys) for c in mine["collectives"]] == collectives(name, step, *keys), (
                name,
                step,
            )
            assert mine["loss"] == pytest.approx(runs(name)["steps"][step]["loss"][ranks.rank], rel=1e-5)
        if "held" in run:
            assert run["held"] == runs(name)["held"][ranks.rank], name
