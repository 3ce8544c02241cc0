"""What the FSDP close reading and its check-yourself answers claim, shown on PyTorch FSDP1 itself (torch 2.13.0).

One launch of workers/fsdp1_upstream_worker.py (world 2, CPU/gloo) trains the test GPT under FSDP1
with the defaults and with each option the note discusses; see the worker's docstring for what it records.
Units in forward order: root (embedding, final LayerNorm, output layer and loss; its forward encloses the
layers'), layers.0-2.
Prefetch claims are checked from step 1 on (step 0 records the forward order).
"""

from __future__ import annotations

import pytest

from pin_and_cite.site.estimates import training_memory
from tests.launch import run_worker

pytestmark = pytest.mark.upstream("pytorch")

WORLD = 2
LAYERS = ["layers.0", "layers.1", "layers.2"]
FORWARD_PAIRS = list(zip(["root"] + LAYERS[:-1], LAYERS))  # (unit l, unit l+1)
BACKWARD_PAIRS = [("root", "layers.2"), ("layers.2", "layers.1"), ("layers.1", "layers.0")]  # (current, next)


def results() -> list[dict]:
    return run_worker("fsdp1_upstream_worker.py", WORLD, timeout=240)


def steps(config: str, first: int = 1):
    for result in results():
        yield from result["runs"][config]["steps"][first:]


def issued(step: dict, op: str, unit: str, phase: str) -> float:
    starts = [e["start"] for e in step["events"] if (e["op"], e["unit"], e["phase"]) == (op, unit, phase)]
    assert len(starts) == 1, f"expected one {phase} {op} of {unit}, found {len(starts)}"
    return starts[0]


def inside(step: dict, time: float, span: str) -> bool:
    start, end = step["spans"][span]
    return start <= time <= end


def mark(step: dict, at: str) -> dict:
    found = [m["units"] for m in step["marks"] if m["at"] == at]
    assert len(found) == 1, f"expected one mark {at!r}, found {len(found)}"
    return found[0]


def gathered(units: dict) -> set[str]:
    return {name for name, unit in units.items() if unit["gathered"]}


def test_one_allgather_and_one_reduce_scatter_per_unit_of_many_parameters():
    """Each unit's parameters travel as one padded flat parameter: per step, one all-gather per pass that
    needs them and one reduce-scatter, of padded size (N equal shards), whatever the number of tensors."""
    for result in results():
        units = result["runs"]["default"]["units"]
        for step in result["runs"]["default"]["steps"]:
            for name, unit in units.items():
                assert unit["original_parameters"] > 1
                assert unit["shard_numel"] * WORLD == unit["padded_numel"] < unit["numel"] + WORLD
                events = [(e["op"], e["nbytes"]) for e in step["events"] if e["unit"] == name]
                gathers = 1 if name == "root" else 2
                assert events == [("all_gather", unit["padded_numel"] * 4)] * gathers + [
                    ("reduce_scatter", unit["padded_numel"] * 4)
                ]


def test_default_gathers_each_unit_in_its_own_pre_forward_after_the_previous_computed():
    """forward_prefetch=False: unit l+1's all-gather is issued from its own pre-forward, once unit l's
    forward has returned; every step, not only the first."""
    for step in steps("default", first=0):
        for current, following in FORWARD_PAIRS:
            gather = issued(step, "all_gather", following, "forward")
            assert inside(step, gather, f"{following} pre-forward")
            if current != "root":  # the root's forward encloses the layers'
                assert gather > step["spans"][f"{current} forward"][1]


def test_forward_prefetch_gathers_next_unit_from_current_pre_forward():
    """forward_prefetch=True: from the second step, unit l's pre-forward issues unit l+1's all-gather right
    after its own, before unit l computes; the first step, which records the order, cannot."""
    for step in steps("forward_prefetch"):
        for current, following in FORWARD_PAIRS:
            gather = issued(step, "all_gather", following, "forward")
            assert inside(step, gather, f"{current} pre-forward")
            assert issued(step, "all_gather", current, "forward") < gather < step["spans"][f"{current} forward"][0]
    for result in results():
        first = result["runs"]["forward_prefetch"]["steps"][0]
        for _current, following in FORWARD_PAIRS:
            assert inside(first, issued(first, "all_gather", following, "forward"), f"{following} pre-forward")


def test_rate_limiter_synchronizes_in_unshard_by_default():
    """limit_all_gathers=True (default): `_unshard` takes a free event to synchronize on every step once two
    frees are queued; with limit_all_gathers=False it never does."""
    assert all(step["waits"] > 0 for step in steps("default", first=0))
    assert all(step["waits"] == 0 for step in steps("no_rate_limit", first=0))


def test_backward_pre_is_default_and_prefetches_from_pre_backward():
    """Default backward_prefetch (BACKWARD_PRE): a unit's pre-backward gathers the unit that ran before it in
    forward, before its own gradient computation and reduce-scatter; while it computes, the root (not
    resharded after forward), the unit and the prefetched one are gathered."""
    for step in steps("default", first=0):
        for current, following in BACKWARD_PAIRS:
            gather = issued(step, "all_gather", following, "backward")
            assert inside(step, gather, f"{current} pre-backward")
            if current != "root":
                assert gather < issued(step, "reduce_scatter", current, "backward")
                assert gathered(mark(step, f"{current} pre-backward")) == {"root", current, following}


def test_root_is_not_resharded_after_forward():
    """`_post_forward_reshard` frees every unit but the root: after forward only the root is gathered, and it
    is never all-gathered again in backward."""
    for step in steps("default", first=0):
        assert gathered(mark(step, "root post-forward")) == {"root"}
        assert [e["phase"] for e in step["events"] if e["unit"] == "root" and e["op"] == "all_gather"] == ["forward"]


def test_backward_post_prefetches_after_freeing_current_before_its_reduce_scatter():
    """BACKWARD_POST: the next all-gather comes from the current unit's post-backward, once its gradient is
    computed and its parameters freed, still before its reduce-scatter; at most one block is gathered."""
    for step in steps("backward_post", first=0):
        for current, following in BACKWARD_PAIRS[1:]:
            gather = issued(step, "all_gather", following, "backward")
            assert inside(step, gather, f"{current} post-backward")
            assert gather < issued(step, "reduce_scatter", current, "backward")
            assert current not in gathered(mark(step, f"{current} post-backward"))
        assert max(len(gathered(m["units"]) - {"root"}) for m in step["marks"] if "backward" in m["at"]) == 1
    for step in steps("default", first=0):
        assert max(len(gathered(m["units"]) - {"root"}) for m in step["marks"] if "backward" in m["at"]) == 2


def test_without_backward_prefetch_next_allgather_waits_for_current_reduce_scatter():
    """backward_prefetch=None: a unit is gathered in its own pre-backward, after the reduce-scatter of the
    unit before it in backward: the dependency chain is gradient, reduce-scatter, next all-gather."""
    for step in steps("backward_none", first=0):
        for current, following in BACKWARD_PAIRS[1:]:
            gather = issued(step, "all_gather", following, "backward")
            assert inside(step, gather, f"{following} pre-backward")
            assert gather > issued(step, "reduce_scatter", current, "backward")


def test_root_rearms_forward_prefetch_flags_only_under_forward_prefetch():
    """`_root_pre_forward` sets every unit's pre-forward need (and clears `_prefetched`) only when
    forward_prefetch is set; by the end of the root's pre-forward it has prefetched layers.0."""
    for step in steps("forward_prefetch"):
        units = mark(step, "root pre-forward")
        assert all(units[b]["needs_pre_forward"] for b in LAYERS)
        assert [b for b in LAYERS if units[b]["prefetched"]] == ["layers.0"]
    for step in steps("default"):
        assert not any(unit["needs_pre_forward"] for unit in mark(step, "root pre-forward").values())


def test_post_forward_arms_and_pre_backward_clears_the_pre_backward_need():
    for step in steps("default", first=0):
        for unit in ["root"] + LAYERS:
            assert mark(step, f"{unit} post-forward")[unit]["needs_pre_backward"]
            assert not mark(step, f"{unit} pre-backward")[unit]["needs_pre_backward"]


def test_final_callback_clears_a_prefetch_backward_never_used():
    """UnusedBranch: c's pre-backward prefetches b, whose output never reaches the loss, so b is still
    gathered and `_prefetched` when backward ends; the final callback reshards it and clears the flags."""
    for result in results():
        for step in result["unused_branch"]:
            before, after = mark(step, "final callback start"), mark(step, "final callback")
            assert before["b"]["gathered"] and before["b"]["prefetched"] and before["b"]["needs_pre_backward"]
            assert not any(any(flags.values()) for flags in after.values())


def test_mixed_precision_dtypes_of_allgather_reduce_scatter_shards_and_buffers():
    """MixedPrecision(param_dtype=bf16, reduce_dtype=fp32, buffer_dtype=bf16): all-gathers and compute in
    bf16, reduce-scatters in fp32 of the padded flat size, shards and their gradients fp32, buffers bf16.
    With param_dtype alone, reduce_dtype follows it: bf16 reduce-scatters."""
    for result in results():
        reduce_dtypes = {"mixed": ("float32", 4), "mixed_param_only": ("bfloat16", 2), "default": ("float32", 4)}
        for config, reduce in reduce_dtypes.items():
            run = result["runs"][config]
            gather = ("bfloat16", 2) if config != "default" else ("float32", 4)
            for step in run["steps"]:
                for e in step["events"]:
                    dtype, size = gather if e["op"] == "all_gather" else reduce
                    assert (e["dtype"], e["nbytes"]) == (dtype, run["units"][e["unit"]]["padded_numel"] * size)
                assert step["grad_dtypes"] == ["torch.float32"]
            assert {p[3] for p in run["outside_forward"]["parameters"]} == {"torch.float32"}
            assert {p[3] for p in run["in_forward"]["parameters"]} == {f"torch.{gather[0]}"}
        mixed = result["runs"]["mixed"]
        assert mixed["in_forward"]["buffer_dtype"] == mixed["outside_forward"]["buffer_dtype"] == "torch.bfloat16"
        assert result["runs"]["mixed_param_only"]["outside_forward"]["buffer_dtype"] == "torch.float32"


def test_use_orig_params_exposes_original_names_as_shard_views():
    """use_orig_params=True: outside forward/backward the optimizer sees the original names, each a 1-D
    Parameter holding this rank's part of the shard, size 0 where the rank holds none; inside forward the
    module sees plain tensors of the original shapes, each aligned inside the flat parameter (padding). The
    default exposes only each unit's flat parameter."""
    by_rank = [result["runs"]["use_orig_params"] for result in results()]
    names = [p[0] for p in by_rank[0]["outside_forward"]["parameters"]]
    assert "layers.0.attention.qkv.weight" in names and not any("flat_param" in n for n in names)
    for run in by_rank:
        assert all(p[1] == "Parameter" and len(p[2]) == 1 for p in run["outside_forward"]["parameters"])
        assert any(p[2] == [0] for p in run["outside_forward"]["parameters"])
        assert all(p[1] == "Tensor" for p in run["in_forward"]["parameters"])
        assert any(len(p[2]) == 2 for p in run["in_forward"]["parameters"])
    sizes = [{p[0]: p[2][0] for p in run["outside_forward"]["parameters"]} for run in by_rank]
    full = {p[0]: p[2] for p in by_rank[0]["in_forward"]["parameters"]}
    for name, shape in full.items():  # layers.0's parameters: the ranks' parts add up to the original
        numel = shape[0] * (shape[1] if len(shape) > 1 else 1)
        assert sum(part[f"layers.0.{name}"] for part in sizes) == numel
    default = results()[0]["runs"]["default"]
    flat_names = ["_flat_param"] + [f"{b}._flat_param" for b in LAYERS]
    assert [p[0] for p in default["outside_forward"]["parameters"]] == flat_names
    for unit, flat in by_rank[0]["units"].items():  # each original aligned inside the flat parameter: padding
        assert flat["numel"] > default["units"][unit]["numel"]


def test_memory_formula_matches_ddp_and_fsdp1_bytes_per_rank():
    """The connect-the-dots formula (pin_and_cite.site.estimates.training_memory) against one Adam step of torch
    DDP and of default FSDP1: DDP holds every byte on each rank; FSDP1 a 1/N shard plus < N elements of
    padding per unit."""
    for result in results():
        measured = result["memory"]
        ddp = training_memory(measured["params"], world=WORLD, sharded=False)
        fsdp = training_memory(measured["params"], world=WORLD, sharded=True)
        assert measured["ddp"] == {"params": ddp.params, "grads": ddp.grads, "optimizer": ddp.optimizer}
        for part, per_element in (("params", 4), ("grads", 4), ("optimizer", 8)):
            padding = measured["fsdp"][part] - getattr(fsdp, part)
            assert 0 <= padding < measured["units"] * per_element, (part, padding)
        assert fsdp.total * WORLD == ddp.total
