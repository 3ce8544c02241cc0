"""A modeled timeline at a device's measured rates: the calibration file is schema-checked, its block is the one
measured at the trace's own shapes, forward and backward spans take their own rates, and the diagram names the
device, torch and dtype. The files here are written by hand; tests/reference/test_calibrate.py renders one the
command measured."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import pytest

from pin_and_cite.core.errors import PinAndCiteError
from study import diagrams, plugin
from study.calibration import load_calibration, trace_rates
from study.modeled import Rates, fsdp_modeled, pipeline_modeled
from study.traces import TraceError, load_trace
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"
FORWARD, BACKWARD = 0.002, 0.0005  # TFLOP/s, apart so that a span at the wrong phase's rate shows


def rate(tflops: float) -> dict:
    return {"flops": 1000, "seconds": 1000 / (tflops * 1e12), "tflops": tflops}


def block(name: str, s: int, b: int, h: int, forward: float = FORWARD, backward: float = BACKWARD) -> dict:
    op = {"op": "qkv", "phase": "forward", "shapes": [[s * b, h], [3 * h, h]], **rate(forward)}
    return {
        **dict(name=name, style="gpt2", s=s, b=b, h=h, heads=4, kv_heads=4, ffn=4 * h, tp=1),
        "ops": [op],
        "forward": rate(forward),
        "backward": rate(backward),
    }


CALIBRATION = {
    "kind": "calibration",
    "version": 1,
    "device": "NVIDIA H200",
    "device_type": "cuda",
    "torch": "2.11.0+cu130",
    "cuda": "13.0",
    "dtype": "bfloat16",
    "warmup": 5,
    "repeats": 20,
    "timing": "median of CUDA events",
    # the pipeline traces' micro-batch block (s 8, b 2, h 16) and the FSDP trace's per-rank one (s 16, b 2, h 32)
    "blocks": [block("pipeline", 8, 2, 16), block("fsdp", 16, 2, 32, forward=0.01, backward=0.004)],
}


@pytest.fixture
def notes(tmp_path):
    """A notes folder holding the committed traces (as a link) and calibrations/h200.json."""
    (tmp_path / "traces").symlink_to(NOTES / "traces")
    (tmp_path / "calibrations").mkdir()
    (tmp_path / "calibrations" / "h200.json").write_text(json.dumps(CALIBRATION))
    return tmp_path


def test_each_action_lasts_its_flops_at_its_phases_measured_rate_and_the_axis_names_the_device(notes):
    calibration = load_calibration(notes, "h200")
    trace = load_trace(notes, "pipeline_1f1b")
    html = plugin.helpers(SimpleNamespace(notes_dir=notes))["diagram"](
        "pipeline_1f1b", calibration="h200", link_GBps=25
    )
    assert html == diagrams.diagram(trace, calibration=calibration, link_GBps=25)
    assert ", modeled at the rates of NVIDIA H200, torch 2.11.0+cu130, bfloat16, 25 GB/s</text>" in html
    bars = {
        (bar.row, bar.label): bar for bar in pipeline_modeled(trace, trace_rates(trace, 25, calibration=calibration))
    }
    for r, stage in enumerate(trace["stages"]):
        for action, flops in zip(stage["actions"], stage["action_flops"]):
            bar = bars[f"stage {r}", action]
            assert bar.end - bar.start == pytest.approx(flops / ((FORWARD if action[0] == "F" else BACKWARD) * 1e12))


def test_fsdp_takes_the_block_measured_at_its_per_rank_shape_and_a_stated_rate_keeps_its_figures(notes):
    trace = load_trace(notes, "fsdp_forward")
    rates = trace_rates(trace, 25, calibration=load_calibration(notes, "h200"))
    assert (rates.tflops, rates.backward_tflops) == (0.01, 0.004)  # the "fsdp" block: s 16, b 2, h 32
    spans = {s["name"]: s for s in trace["spans"]}
    compute = {bar.label: bar for bar in fsdp_modeled(trace, rates) if bar.kind.endswith("compute")}
    for name in ("layers.0 forward", "layers.1 forward"):  # leaf spans: exactly their FLOPs, no stall inside
        assert compute[name].end - compute[name].start == pytest.approx(
            (spans[name]["flops_end"] - spans[name]["flops_start"]) / 0.01e12
        )
    # one stated rate for both phases draws what it drew before calibrations existed
    assert fsdp_modeled(trace, Rates(1, 25)) == fsdp_modeled(trace, Rates(1, 25, backward_tflops=1))


def test_a_trace_whose_shapes_were_not_measured_or_not_recorded_is_a_one_line_error(notes):
    calibration = load_calibration(notes, "h200")
    only_fsdp = {**calibration, "blocks": calibration["blocks"][1:]}
    with pytest.raises(TraceError) as error:
        diagrams.diagram(load_trace(notes, "pipeline_gpipe"), calibration=only_fsdp, link_GBps=25)
    assert "ran style gpt2, tp 1, s 8, b 2, h 16, which calibration 'NVIDIA H200' did not measure" in str(error.value)
    assert "python -m reference.measure.calibrate" in str(error.value) and "\n" not in str(error.value)
    shapeless = copy.deepcopy(load_trace(notes, "fsdp_forward"))
    del shapeless["h"]
    with pytest.raises(TraceError, match="records no s, b and h .*re-record with tools/record-traces"):
        diagrams.diagram(shapeless, calibration=calibration, link_GBps=25)
    for options in ({}, {"tflops": 1, "calibration": calibration}):
        with pytest.raises(TraceError, match="takes tflops= or calibration=, one of them"):
            diagrams.diagram(load_trace(notes, "pipeline_gpipe"), link_GBps=25, **options)


def _without(key):
    return lambda data: data.pop(key)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (_without("device"), "'device' is a required property"),
        (lambda d: d.update(host="gpu-7"), "Additional properties are not allowed ('host' was unexpected)"),
        (lambda d: d.update(version=2), "version: 2 is not one of [1]"),
        (lambda d: d.update(blocks=[]), "blocks: [] should be non-empty"),
        (lambda d: d["blocks"][0]["forward"].update(tflops=0), "blocks[0].forward.tflops 0 is not a positive TFLOP/s"),
        (lambda d: d["blocks"][1]["ops"][0].update(seconds=-1.0), "is not a positive number of seconds"),
        (lambda d: d["blocks"][0].update(style="bert"), "blocks[0].style: 'bert' is not one of ['gpt2', 'llama']"),
        # extremes (N11): a rate that makes a span last forever or no time, a count of seconds past any step's
        (lambda d: d["blocks"][0]["forward"].update(tflops=1e-320), "1e-320 is not a positive TFLOP/s (1e-6 to 1e6)"),
        (lambda d: d["blocks"][0]["backward"].update(tflops=1e300), "1e+300 is not a positive TFLOP/s"),
        (lambda d: d["blocks"][1]["ops"][0].update(seconds=1e300), "1e+300 is not a positive number of seconds"),
        (lambda d: d["blocks"][0]["forward"].update(tflops=float("inf")), "Infinity is not a number a device measured"),
        (lambda d: d["blocks"][0]["forward"].update(tflops=float("nan")), "NaN is not a number a device measured"),
    ],
)
def test_a_calibration_that_does_not_fit_its_schema_is_a_one_line_error(notes, change, problem):
    data = copy.deepcopy(CALIBRATION)
    change(data)
    (notes / "calibrations" / "h200.json").write_text(json.dumps(data))
    with pytest.raises(PinAndCiteError) as error:
        load_calibration(notes, "h200")
    message = str(error.value)
    assert message.startswith(f"{notes.name}/calibrations/h200.json ") and problem in message, message
    assert message.endswith("; measure one with python -m reference.measure.calibrate") and "\n" not in message


def test_a_missing_unreadable_or_oddly_named_calibration_is_a_one_line_error(notes):
    (notes / "calibrations" / "broken.json").write_text("{")
    cases = {
        "a100": "no calibration 'a100' (",
        "broken": "calibrations/broken.json is not valid JSON",
        "../traces/tp_block": "calibration name '../traces/tp_block' must be letters, digits, '_' or '-'",
    }
    for name, problem in cases.items():
        with pytest.raises(PinAndCiteError) as error:
            load_calibration(notes, name)
        assert problem in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(PinAndCiteError, match=r"calibrations: broken, h200\); measure one with"):
        load_calibration(notes, "a100")


@pytest.mark.parametrize("spelling", ["<", "\\u003c", "\\u003C"])
def test_a_calibration_reads_as_page_text_however_json_spells_its_tags(notes, spelling):
    """A `<` in any JSON spelling reaches a page as `&lt;`, never a live tag (fences.page_text)."""
    text = json.dumps(CALIBRATION).replace('"NVIDIA H200"', f'"H200{spelling}script>"')
    (notes / "calibrations" / "h200.json").write_text(text)
    assert load_calibration(notes, "h200")["device"] == "H200&lt;script>"
