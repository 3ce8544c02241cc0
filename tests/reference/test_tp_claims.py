"""The claims the reading notes make about Megatron-style tensor parallelism, checked on recorded runs.

One torchrun launch per world size records a training step of a one-block TP transformer in four
configurations (tests/reference/workers/tp_claims_worker.py); each test below reads those logs. Activations
are [s, b, h] = [8, 2, 16] in fp32, so one activation is N = b*s*h*4 = 1024 bytes.
"""

import pytest

from tests.launch import run_worker
from tests.reference.gpus import WORLDS, world_id


@pytest.fixture(scope="module", params=WORLDS, ids=world_id)
def run(request):
    world, device = request.param
    results = run_worker("tp_claims_worker.py", world, device=device, timeout=180)
    logs = {name: [result["logs"][name] for result in results] for name in results[0]["logs"]}
    return {"world": world, "results": results, "logs": logs}


def events(run, config, rank=0, phase=None, module_prefix=""):
    return [
        e
        for e in run["logs"][config][rank]["events"]
        if (phase is None or e["phase"] == phase) and e["module"].startswith(module_prefix)
    ]


def activation_bytes(run, config="tp"):
    log = run["logs"][config][0]
    return log["b"] * log["s"] * log["h"] * log["dtype_size"]


def ops(evs):
    return [(e["op"], e["module"]) for e in evs]


def test_one_allreduce_per_mlp_forward_and_backward(run):
    for rank in range(run["world"]):
        assert ops(events(run, "tp", rank, "forward", "layers.0.mlp")) == [("all_reduce", "layers.0.mlp.fc2")]
        assert ops(events(run, "tp", rank, "backward", "layers.0.mlp")) == [("all_reduce", "layers.0.mlp.fc1")]


def test_two_allreduces_per_block_each_way_without_sequence_parallel(run):
    for rank in range(run["world"]):
        assert ops(events(run, "tp", rank, "forward")) == [
            ("all_reduce", "layers.0.attention.proj"),
            ("all_reduce", "layers.0.mlp.fc2"),
        ]
        assert ops(events(run, "tp", rank, "backward")) == [
            ("all_reduce", "layers.0.mlp.fc1"),
            ("all_reduce", "layers.0.attention.qkv"),
        ]


def test_bytes_per_collective_equal_b_s_h_dtype_size(run):
    n = activation_bytes(run)
    for config in ("tp", "sp"):
        block = events(run, config, module_prefix="layers.0")
        assert block and {e["nbytes"] for e in block} == {n}, [(e["op"], e["nbytes"]) for e in block]
        assert all(e["group_ranks"] == list(range(run["world"])) for e in block)


def _ring_bytes(evs, p):
    """Bytes each rank sends with ring algorithms: all-reduce 2(p-1)/p N, all-gather and reduce-scatter (p-1)/p N."""
    per_op = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p}
    return sum(per_op[e["op"]] * e["nbytes"] for e in evs)


def test_sequence_parallel_turns_allreduce_into_allgather_and_reducescatter_of_equal_volume(run):
    p, n = run["world"], activation_bytes(run)
    tp_fwd, sp_fwd = (
        events(run, "tp", phase="forward", module_prefix="layers.0"),
        events(run, "sp", phase="forward", module_prefix="layers.0"),
    )
    assert ops(sp_fwd) == [
        ("all_gather", "layers.0.attention.qkv"),
        ("reduce_scatter", "layers.0.attention.proj"),
        ("all_gather", "layers.0.mlp.fc1"),
        ("reduce_scatter", "layers.0.mlp.fc2"),
    ]
    assert _ring_bytes(sp_fwd, p) == _ring_bytes(tp_fwd, p) == 4 * (p - 1) / p * n
    # Backward: the conjugates (all-gather for each reduce-scatter, reduce-scatter of dX for each all-reduce)
    # carry the same volume; on top, each column layer re-gathers its input (not kept, to save memory).
    sp_bwd = events(run, "sp", phase="backward", module_prefix="layers.0")
    assert ops(sp_bwd) == [
        ("all_gather", "layers.0.mlp.fc2"),
        ("all_gather", "layers.0.mlp.fc1"),
        ("reduce_scatter", "layers.0.mlp.fc1"),
        ("all_gather", "layers.0.attention.proj"),
        ("all_gather", "layers.0.attention.qkv"),
        ("reduce_scatter", "layers.0.attention.qkv"),
    ]
    regathers = [e for e in sp_bwd if e["op"] == "all_gather" and e["async_op"]]
    assert [e["module"] for e in regathers] == ["layers.0.mlp.fc1", "layers.0.attention.qkv"]
    conjugates = [e for e in sp_bwd if e not in regathers]
    tp_bwd = events(run, "tp", phase="backward", module_prefix="layers.0")
    assert _ring_bytes(conjugates, p) == _ring_bytes(tp_bwd, p) == 4 * (p - 1) / p * n


def test_input_grad_collective_is_async_unless_disabled(run):
    for config, overlapped in (("tp", True), ("sp", True), ("tp_no_async", False), ("sp_no_async", False)):
        dgrad = [
            e
            for e in events(run, config, phase="backward", module_prefix="layers.0")
            if e["module"].endswith(("qkv", "fc1"))
        ]
        assert dgrad and all(e["async_op"] is overlapped for e in dgrad), (config, dgrad)
        assert all(e["end"] >= e["start"] for e in dgrad)
    strip = lambda evs: [(e["op"], e["module"], e["nbytes"], e["phase"]) for e in evs]
    assert strip(events(run, "tp")) == strip(events(run, "tp_no_async"))
    assert strip(events(run, "sp")) == strip(events(run, "sp_no_async"))


def test_ffn_derivation_shards_concatenate_partials_sum_dx_allreduced_dw_local(run):
    """Column then row on p ranks (p=2: the 2-way derivation): the O_i = X A_i concatenate to O; the partial
    Y_i = GELU(O_i) B_i sum to Y and none alone is Y; the dO_i A_i sum to dX (the all-reduce) and none alone is
    dX; dA_i, dB_i are slices of dA, dB with no collective (the only one in backward is dX's all-reduce).
    Each rank asserted the tensor equalities (workers/tp_claims_worker.py)."""
    s, b, h = (run["logs"]["tp"][0][k] for k in ("s", "b", "h"))
    for result in run["results"]:
        assert result["ffn_backward_collectives"] == [["all_reduce", [s, b, h]]]


def test_grad_accumulation_fusion_accumulates_into_main_grad(run):
    for result in run["results"]:  # main_grad equal to the plain model's grad: asserted on each rank
        assert result["grad_accumulation_fusion"] == {"fc1_grad_is_none": True, "fc1_main_grad_dtype": "torch.float32"}


def test_dropout_masks_shared_on_replicas_and_independent_on_shards(run):
    for result in run["results"]:
        dropout = result["dropout"]
        for sp in (False, True):
            assert dropout[f"sp={sp}"]["replicas_equal"], f"sp={sp}: TP replicas drifted apart"
            assert dropout[f"sp={sp}"]["eval_differs"], "dropout should be active in training mode"
        assert dropout["default_stream_kept"], "fork() must leave the default stream as it was"
        assert dropout["distinct_sharded_draws"] == run["world"], "each TP rank should draw its own sharded mask"
