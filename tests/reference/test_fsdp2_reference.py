"""The reference FSDP2 (reference.fsdp2) against PyTorch's `fully_shard`, on CPU/gloo at world 2 and 4.

Same model, same weights, same batches (tests/reference/fsdp2_runs.py): the losses, the sharded gradients of
every step and the final shards are bit-equal (both do the same operations in the same order: the same
copies into the same flat buffers, the same averaging collectives, the same SGD on the same rows), and the
collectives each rank issues (kind, group, bytes, dtype, phase, unit) and the issue order around the compute
(prefetches marked) are FSDP2's, step by step, in every configuration: fp32, bf16 compute with fp32 reduction,
explicit forward and backward prefetch, `reshard_after_forward` False (world 2) and 2 (world 4), and HSDP on
a 2 x 2 mesh (world 4).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from reference.gpt.model import GPT
from tests.ranks import on_ranks
from tests.reference.fsdp2_runs import BOTH, CONFIG, SEED, configs, differences, fsdp2_results
from tests.reference.helpers import demo_output, json_lines

FP32_TOLERANCE = 1e-6  # against single-process training on the whole batch: the batch-split summation order


def runs(ranks, name: str) -> tuple[dict, dict]:
    result = fsdp2_results(ranks.device)
    return tuple(result["runs"][name, implementation] for implementation in BOTH)


@on_ranks(2, 4)
def test_losses_gradients_and_shards_equal_fully_shard_bitwise(ranks):
    result = fsdp2_results(ranks.device)
    for name in configs(ranks.world):
        assert differences(result, name) == {"loss": 0.0, "grads": 0.0, "shards": 0.0}, name


@on_ranks(2, 4)
def test_collectives_kind_group_bytes_and_unit_equal_fully_shard_in_order(ranks):
    for name in configs(ranks.world):
        ours, theirs = runs(ranks, name)
        for step, (a, b) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
            assert a["events"] == b["events"], f"{name} step {step}"
            assert {unit for *_, unit in a["events"]} == {"root", "layers.0", "layers.1", "layers.2"}


@on_ranks(2, 4)
def test_issue_order_around_the_compute_equals_fully_shard(ranks):
    """Compute spans and collectives interleaved, prefetches marked: where each all-gather is issued."""
    for name in configs(ranks.world):
        ours, theirs = runs(ranks, name)
        for step, (a, b) in enumerate(zip(ours["steps"], theirs["steps"], strict=True)):
            assert a["issue_order"] == b["issue_order"], f"{name} step {step}"


@on_ranks(2, 4)
def test_one_all_gather_and_one_reduce_scatter_per_group_of_per_parameter_padded_shards(ranks):
    """Each group's all-gather moves, and its reduce-scatter averages, every parameter's dim 0 padded to a
    multiple of the world size; each rank holds 1/world of that (counted here from the shapes alone)."""
    model, world = GPT(CONFIG, SEED), ranks.world
    padded = {
        unit: sum(math.ceil(p.shape[0] / world) * world * p[0].numel() * 4 for p in module.parameters())
        for unit, module in [
            ("layers.0", model.layers[0]),
            ("layers.1", model.layers[1]),
            ("layers.2", model.layers[2]),
        ]
    }
    padded["root"] = sum(math.ceil(p.shape[0] / world) * world * p[0].numel() * 4 for p in model.parameters()) - sum(
        padded.values()
    )
    ours, theirs = runs(ranks, "fp32")
    for step in ours["steps"]:
        forward = [(op, unit, nbytes) for op, _, nbytes, _, phase, unit in step["events"] if phase == "forward"]
        assert forward == [("all_gather", unit, padded[unit]) for unit in ("root", "layers.0", "layers.1", "layers.2")]
        reduced = {unit: nbytes for op, _, nbytes, _, _, unit in step["events"] if op == "reduce_scatter"}
        assert reduced == padded
    assert ours["shard_bytes"] == theirs["shard_bytes"] == sum(padded.values()) // world


@on_ranks(2, 4)
def test_mixed_precision_gathers_in_bf16_and_reduces_in_fp32(ranks):
    fp32, bf16 = (runs(ranks, name)[0]["steps"][0]["events"] for name in ("fp32", "bf16"))
    for (op, group, nbytes, dtype, *_), (op2, group2, nbytes2, dtype2, *_) in zip(fp32, bf16, strict=True):
        assert (op, group) == (op2, group2)
        if op == "all_gather":
            assert (dtype, dtype2, nbytes2) == ("float32", "bfloat16", nbytes // 2)
        else:
            assert (dtype, dtype2, nbytes2) == ("float32", "float32", nbytes)


@on_ranks(2, 4)
def test_backward_prefetch_implicit_then_explicit(ranks):
    """Implicitly, each unit's pre-backward all-gathers the unit before it in forward order; explicit lists
    (each unit the next two in backward order) issue layers.0's all-gather before layers.2's reduce-scatter."""
    ours = runs(ranks, "fp32")[0]["steps"][1]
    backward = [(op, unit, early) for phase, op, unit, early in ours["issue_order"] if phase == "backward"]
    assert backward[:2] == [("all_gather", "layers.2", True), ("compute", "root", None)]
    assert [(op, unit) for op, unit, _ in backward if not op.startswith("compute")] == [
        ("all_gather", "layers.2"),
        ("all_gather", "layers.1"),
        ("reduce_scatter", "layers.2"),
        ("all_gather", "layers.0"),
        ("reduce_scatter", "layers.1"),
        ("reduce_scatter", "layers.0"),
        ("reduce_scatter", "root"),
    ]
    explicit = runs(ranks, "explicit")[0]["steps"][1]
    collectives = [
        (op, unit)
        for phase, op, unit, _ in explicit["issue_order"]
        if phase == "backward" and not op.startswith("compute")
    ]
    assert collectives.index(("all_gather", "layers.0")) < collectives.index(("reduce_scatter", "layers.2"))


@on_ranks(2)
def test_explicit_forward_prefetch_issues_the_next_all_gather_before_the_current_compute_from_step_0(ranks):
    for name, expected in (("fp32", False), ("explicit", True)):
        for step in runs(ranks, name)[0]["steps"]:
            forward = [(op, unit) for phase, op, unit, _ in step["issue_order"] if phase == "forward"]
            early = forward.index(("all_gather", "layers.1")) < forward.index(("compute", "layers.0"))
            assert early == expected, name


@on_ranks(2)
def test_reshard_after_forward_false_gathers_nothing_in_backward(ranks):
    """By default the root keeps its parameters (its backward runs first) and every layer re-gathers."""
    for name, backward_gathers in (("fp32", ["layers.2", "layers.1", "layers.0"]), ("keep", [])):
        for step in runs(ranks, name)[0]["steps"]:
            gathered = [
                unit for op, _, _, _, phase, unit in step["events"] if (op, phase) == ("all_gather", "backward")
            ]
            assert gathered == backward_gathers, name


@on_ranks(4)
def test_reshard_after_forward_2_gathers_backward_over_pairs_of_ranks(ranks):
    group = (0, 1) if ranks.rank < 2 else (2, 3)
    for step in runs(ranks, "reshard2")[0]["steps"]:
        for op, ranks_of, _, _, phase, unit in step["events"]:
            if op == "all_gather":
                assert ranks_of == (group if phase == "backward" else (0, 1, 2, 3)), unit


@on_ranks(4)
def test_hsdp_on_a_2x2_mesh_equals_fully_shard_on_a_2d_mesh(ranks):
    """Shard within a row of the grid [[0, 1], [2, 3]], replicate down a column: each group's gradients are
    reduce-scattered in the row, then all-reduced (averaged) in the column; bit-equal to `fully_shard` on
    `DeviceMesh(..., mesh_dim_names=("replicate", "shard"))`, and close to single-process training."""
    result = fsdp2_results(ranks.device)
    row, column = ((0, 1), (2, 3))[ranks.rank // 2], ((0, 2), (1, 3))[ranks.rank % 2]
    assert differences(result, "hsdp") == {"loss": 0.0, "grads": 0.0, "shards": 0.0}
    ours, theirs = runs(ranks, "hsdp")  # with explicit forward prefetch
    for a, b in zip(ours["steps"], theirs["steps"], strict=True):
        assert a["events"] == b["events"] and a["issue_order"] == b["issue_order"]
        groups = {
            op: {e[1] for e in a["events"] if e[0] == op} for op in ("all_gather", "reduce_scatter", "all_reduce")
        }
        assert groups == {"all_gather": {row}, "reduce_scatter": {row}, "all_reduce": {column}}
        kinds = [op for op, *_ in a["events"] if op != "all_gather"]
        assert kinds == ["reduce_scatter", "all_reduce"] * 4  # each group's all-reduce right after its reduce
    assert result["single"]["hsdp"] <= FP32_TOLERANCE


@on_ranks(1)
def test_one_rank_issues_no_collective_and_trains_bitwise_like_single_process(ranks):
    """A shard group of one rank: the copy-in is the whole all-gather and the gradient is its own reduction, so
    neither FSDP2 issues a collective, and the training is the single process's, bit for bit."""
    result = fsdp2_results(ranks.device)
    for name in configs(1):
        assert differences(result, name) == {"loss": 0.0, "grads": 0.0, "shards": 0.0}, name
        for run in runs(ranks, name):
            assert all(step["events"] == [] for step in run["steps"]), name
    assert result["single"]["fp32"] == 0.0


@on_ranks(2)
def test_fully_shard_refuses_in_one_line(ranks):
    from reference.fsdp2 import MixedPrecisionPolicy, fully_shard

    def refusal(build) -> str:
        with pytest.raises(ValueError) as error:
            build()
        return str(error.value)

    def twice():
        layer = GPT(CONFIG, SEED).layers[0]
        fully_shard(layer)
        fully_shard(layer)

    def shared_between_groups():
        model = GPT(dataclasses.replace(CONFIG, share_embeddings_and_output_weights=True), SEED)
        fully_shard(model.output_layer)
        fully_shard(model)

    assert refusal(twice) == "FSDPTransformerBlock is already fully_shard-ed; apply fully_shard once per module"
    assert refusal(shared_between_groups) == (
        "parameter 'embedding.word_embeddings.weight' is shared with 'another fully_shard group': "
        "put the modules sharing it under one fully_shard call"
    )
    assert refusal(lambda: fully_shard(GPT(CONFIG, SEED).layers[0], reshard_after_forward=3)) == (
        "reshard_after_forward=3: expected a divisor of the shard group size 2"
    )
    fp16 = MixedPrecisionPolicy(reduce_dtype=torch.float16)
    assert refusal(lambda: fully_shard(GPT(CONFIG, SEED).layers[0], mp_policy=fp16)) == (
        "reduce_dtype must be float32 or bfloat16 (reduced by averaging), got torch.float16"
    )


@on_ranks(2, 4)
def test_trains_like_single_process(ranks):
    result = fsdp2_results(ranks.device)
    for name in ("fp32", "explicit"):
        assert result["single"][name] <= FP32_TOLERANCE, name


def by_rank_and_step(record: dict) -> tuple[int, int]:
    return record["rank"], record["step"]


DEMO = ("--fsdp", "--fsdp-version", "2", "--json", "--steps", "2", "--num-layers", "2", "--hidden-size", "32")


@on_ranks(2)
def test_demo_fsdp_version_2_prints_what_use_torch_fsdp_prints(ranks):
    """`-m reference --fsdp --fsdp-version 2` against `--use-torch-fsdp` (PyTorch's `fully_shard`): every rank's
    and step's loss, parameter bytes, collectives and issue order equal; the text shows the issue order."""
    flags = [*DEMO, "--forward-prefetch", "--mixed-precision"]
    ours, theirs = json_lines(demo_output(flags)), json_lines(demo_output([*flags, "--use-torch-fsdp"]))
    assert sorted((r["rank"], r["step"]) for r in ours) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for a, b in zip(sorted(ours, key=by_rank_and_step), sorted(theirs, key=by_rank_and_step), strict=True):
        assert (a["loss"], a["param_bytes_per_rank"], a["issue_order"]) == (
            b["loss"],
            b["param_bytes_per_rank"],
            b["issue_order"],
        )
        assert [(e["op"], e["module"], e["nbytes"], e["dtype"]) for e in a["events"]] == [
            (e["op"], e["module"], e["nbytes"], e["dtype"]) for e in b["events"]
        ]
    text = demo_output([f for f in flags if f != "--json"])
    assert "forward  all_gather     layers.1" in text and text.count("prefetch\n") == 4


@on_ranks(2)
def test_demo_refuses_a_mesh_that_does_not_divide_the_world_in_one_line(ranks):
    for flags, message in (
        (["--dp-replicate", "3"], "reference: error: --dp-replicate 3 does not divide the 2 ranks"),
        (["--reshard-after-forward", "4"], "reference: error: --reshard-after-forward 4 does not divide"),
    ):
        with pytest.raises(SystemExit) as exit_:
            demo_output([*DEMO, *flags])
        assert exit_.value.code == 2, (flags, message)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--backward-prefetch", "post"], "--backward-prefetch post: FSDP2 prefetches in backward"),
        (["--cpu-offload"], "--cpu-offload: the reference FSDP2 keeps its shards on the compute device"),
        (["--fsdp-version", "1", "--dp-replicate", "2"], "--dp-replicate is FSDP2's; add --fsdp-version 2"),
    ],
)
def test_demo_refuses_an_option_of_the_other_version_in_one_line_before_starting(flags, message, capsys):
    from reference.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main([*DEMO, *flags, "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and message in err, err
