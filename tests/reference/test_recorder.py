"""The collective recorder on real collectives (gloo; NCCL on CUDA), eager c10d, functional (DTensor-style),
FSDP1 and FSDP2, at world size 2 (TP groups at 4 and 64 ranks are covered by the TP tests).

One launch of workers/recorder_worker.py runs every check; each test compares what one check recorded on
every rank with what it should have recorded."""

import pytest

from tests.launch import run_worker
from tests.reference.gpus import DEVICES

WORLD = 2
EVERYONE = list(range(WORLD))

pytestmark = pytest.mark.parametrize("device", DEVICES)


def checks(device: str, name: str) -> list:
    """What check `name` recorded, on every rank."""
    return [result[name] for result in run_worker("recorder_worker.py", WORLD, device=device, timeout=120)]


def test_collectives_still_work_after_the_recorder_exits(device):
    assert checks(device, "torch_distributed_intact_after_exit") == [float(WORLD)] * WORLD


def test_eager_ops_are_recorded_with_group_shape_bytes_dtype_phase(device):
    full = 4 * WORLD * 3 * 4
    for got in checks(device, "eager_ops"):
        assert got["events"] == [
            ["all_reduce", EVERYONE, [4, 3], 48, "float32", "forward", False],
            ["all_gather", EVERYONE, [4 * WORLD, 3], full, "float32", "forward", False],
            ["all_gather", EVERYONE, [4 * WORLD, 3], full, "float32", "forward", False],
            ["reduce_scatter", EVERYONE, [4, 3], 48, "float32", "forward", False],
            ["reduce_scatter", EVERYONE, [4, 3], 48, "float32", "forward", False],
            ["all_gather", EVERYONE, [4 * WORLD, 3], full, "float32", "forward", False],
            ["broadcast", EVERYONE, [4, 3], 48, "float32", "forward", False],
            ["all_reduce", EVERYONE, [4, 3], 24, "bfloat16", "forward", False],
        ]
        assert got["ended_after_start"]
        assert got["summary"] == {
            "all_reduce": {"count": 2, "bytes": 72},
            "all_gather": {"count": 3, "bytes": 3 * full},
            "reduce_scatter": {"count": 2, "bytes": 96},
            "broadcast": {"count": 1, "bytes": 48},
        }


def test_an_async_collective_ends_when_it_is_waited_on(device):
    for got in checks(device, "async_end_is_wait_time"):
        assert len(got["events"]) == 1
        event = got["events"][0]
        assert event["async_op"]
        assert 0.2 <= event["end"] - event["start"] and event["end"] <= got["after_wait"], got


def test_a_subgroup_collective_records_the_subgroup_ranks(device):
    assert checks(device, "subgroup_ranks") == [[] for _ in range(WORLD - 1)] + [[[WORLD - 1]]]


def test_point_to_point_is_recorded_on_both_ends(device):
    assert checks(device, "point_to_point") == [[["send", 20]], [["recv", 20]]]


def test_functional_collectives_are_recorded_and_still_compute(device):
    for got in checks(device, "functional_collectives"):
        assert got["all_reduce"] == [[float(WORLD)] * 2] * 4 and got["all_gather_shape"] == [4 * WORLD, 2]
        assert got["reduce_scatter"] == [[WORLD * 1.0] * 2] * (4 // WORLD)
        assert got["events"] == [
            ["all_reduce", EVERYONE, [4, 2], 32],
            ["all_gather", EVERYONE, [4 * WORLD, 2], 32 * WORLD],
            ["reduce_scatter", EVERYONE, [4, 2], 32],
        ]


def test_fsdp2_collectives_are_attributed_to_their_unit_at_the_full_flat_size(device):
    full = {"net.0": (8 * 16 + 16) * 4, "net.2": (16 * 4 + 4) * 4}  # fp32 bytes of each unit's parameters
    for got in checks(device, "fsdp2_unit_attribution"):
        assert got["forward"] == [["all_gather", "net.0", full["net.0"]], ["all_gather", "net.2", full["net.2"]]]
        assert got["backward_reduce_scatters"] == sorted(full.values())


def test_fsdp1_reduce_scatter_is_attributed_to_the_unit_owning_the_flat_parameter(device):
    for got in checks(device, "fsdp1_post_backward_attribution"):
        assert got == [
            ["net._fsdp_wrapped_module.2._fsdp_wrapped_module", (16 * 4 + 4) * 4],
            ["net._fsdp_wrapped_module.0._fsdp_wrapped_module", (8 * 16 + 16) * 4],
        ]


def test_phase_module_spans_json_and_explicit_scope(device):
    for rank, got in enumerate(checks(device, "phase_module_and_spans")):
        assert got["events"] == [["all_reduce", "forward", "net.0"], ["all_reduce", "backward", "net.0"]]
        assert len(got["spans"]) == 1
        span = got["spans"][0]
        assert span["name"] == "forward" and span["phase"] == "forward" and span["end"] >= span["start"]
        data = got["to_json"]
        assert data["rank"] == rank and len(data["events"]) == 2 and data["events"][0]["start"] >= 0
        assert data["summary"] == got["summary"]
        assert got["backward_summary"] == {"all_reduce": {"count": 1, "bytes": 32}}
        assert got["scoped_module"] == "explicit"


def test_spans_and_collectives_are_stamped_with_the_flops_flop_counter_mode_counts(device):
    """The FLOPs a span ran are what FlopCounterMode counts (2 x 3 x 8 x 4 for a Linear(8, 4) on 3 rows); a
    collective carries the FLOPs counted before it, in the object and in its JSON."""
    for got in checks(device, "flop_stamps"):
        assert got["counted"] == 2 * 3 * 8 * 4
        assert got["span"] == [0, got["counted"]] and got["events"] == [0, got["counted"]]
        assert got["json_span_end"] == got["json_event"] == got["counted"]
