"""The diagrams and numbers drawn from the committed traces say what the traces recorded. That the traces are what
the reference does now is tests/evidence/test_trace_freshness.py's fresh run."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from reference.pipeline.zero_bubble import (
    V_SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    bubble_formula,
    flat,
    peak_in_flight,
    rank_order,
    stages_of,
)
from study import diagrams, estimates, record_traces
from study.modeled import Rates, pipeline_modeled
from study.traces import forward_markers, load_trace, pipeline_slots
from tests.pipeline_orders import textbook
from tests.tools.conftest import ROOT

NOTES = ROOT / "reading_notes"


def test_tp_trace_records_two_allreduces_of_b_s_h_bytes_each_way():
    trace = load_trace(NOTES, "tp_block")
    for run in trace["runs"]:
        n = trace["b"] * trace["s"] * run["h"] * trace["dtype_size"]
        assert [(e["op"], e["module"], e["phase"], e["nbytes"]) for e in run["events"]] == [
            ("all_reduce", "layers.0.attention.proj", "forward", n),
            ("all_reduce", "layers.0.mlp.fc2", "forward", n),
            ("all_reduce", "layers.0.mlp.fc1", "backward", n),
            ("all_reduce", "layers.0.attention.qkv", "backward", n),
        ]


def test_llama_trace_records_the_gpt2_blocks_collectives_with_kv_heads_split():
    """The Llama/Qwen2 block issues exactly the GPT-2 block's collectives; its fused column layers hold each
    rank's whole query groups ((heads + 2 kv_heads) / tp head rows) and [gate; up] (2 ffn / tp rows)."""
    gpt2, llama = load_trace(NOTES, "tp_block"), load_trace(NOTES, "tp_block_llama")
    assert (gpt2["style"], llama["style"]) == ("gpt2", "llama") and llama["kv_heads"] < llama["heads"]
    assert llama["tp"] == 2 and llama["kv_heads"] % llama["tp"] == 0
    for run, gpt2_run in zip(llama["runs"], gpt2["runs"], strict=True):
        h = run["h"]
        assert [(e["op"], e["module"], e["phase"], e["nbytes"]) for e in run["events"]] == [
            (e["op"], e["module"], e["phase"], e["nbytes"]) for e in gpt2_run["events"]
        ]
        weights = {step["module"]: step["weight_shape"] for step in run["forward_steps"] if "module" in step}
        head_dim, tp = h // llama["heads"], llama["tp"]
        assert weights["layers.0.attention.qkv"] == [(llama["heads"] + 2 * llama["kv_heads"]) * head_dim // tp, h]
        assert weights["layers.0.mlp.fc1"] == [2 * 4 * h // tp, h]
        assert weights["layers.0.ln1"] == weights["layers.0.ln2"] == [h]


def test_fsdp2_trace_issues_fsdp1s_collectives_but_each_reduce_scatter_when_its_groups_backward_ends():
    """The reference FSDP2's recorded step (fsdp2_forward, each group prefetching the next in forward) against the
    reference FSDP1's (fsdp_forward, forward_prefetch): the same units and sizes (nothing pads at N = 2), the
    same collectives in the same order with the same bytes, all-gathers issued at the same points against the
    compute; FSDP1 issues every reduce-scatter after the last backward FLOP, FSDP2 each one as its group's
    backward ends (layers.1's before layers.0's backward starts), as the walkthrough's FSDP2 timeline shows."""
    fsdp1, fsdp2 = load_trace(NOTES, "fsdp_forward"), load_trace(NOTES, "fsdp2_forward")
    assert fsdp2["units"] == fsdp1["units"]
    keys = ("op", "module", "phase", "nbytes", "dtype")
    assert [[e[k] for k in keys] for e in fsdp2["events"]] == [[e[k] for k in keys] for e in fsdp1["events"]]
    assert forward_markers(fsdp2) == forward_markers(fsdp1)
    last = max(span["flops_end"] for span in fsdp1["spans"])
    ends = {span["name"]: span["flops_end"] for span in fsdp2["spans"]}
    for one, two in zip(fsdp1["events"], fsdp2["events"], strict=True):
        if one["op"] == "reduce_scatter":
            assert (one["flops"], two["flops"]) == (last, ends[f"{two['module']} backward"])
        else:
            assert two["flops"] == one["flops"]
    starts = {span["name"]: span["flops_start"] for span in fsdp2["spans"]}
    assert ends["layers.1 backward"] == starts["layers.0 backward"] < last


def chart_parts(chart: str) -> tuple[dict, list, list]:
    """A flowchart's node labels by id, its chain edges (from, to, label or None) and its dotted edges."""
    nodes = dict(re.findall(r'\b(n\d+)\["([^"]*)"\]', chart))
    chain = []
    for line in chart.split("\n"):
        if "-.->" in line:
            continue
        for a, arrow, b in re.findall(r'(\w+) (-->|==>\|"[^"]*"\|) (?=(\w+))', line):
            chain.append((a, b, arrow[5:-2] if arrow.startswith("==>") else None))
    dotted = re.findall(r'(\w+) -\.->\|"([^"]*)"\| (\w+)', chart)
    return nodes, chain, dotted


def test_llama_diagram_draws_the_recorded_block_in_order_with_its_collectives():
    """Node by node, the flowchart is the trace: the block's leaf modules in recorded forward order (named
    module · type), rotary and SwiGLU as the op groups between them, each forward all-reduce on the edge
    leaving the module that issued it, each backward one dotted from that module back to its input."""
    trace = load_trace(NOTES, "tp_block_llama")
    run = trace["runs"][0]
    nodes, chain, dotted = chart_parts(diagrams.diagram(trace, link="NVLink"))
    path = [a for a, _, _ in chain] + [chain[-1][1]]
    assert path[0] == "x" and path[-1] == "y" and sorted(path[1:-1]) == sorted(nodes)
    labels = [nodes[n] for n in path[1:-1]]
    modules = [s["module"] for s in run["forward_steps"] if s.get("module", "").startswith("layers.0.")]
    types = [s["type"] for s in run["forward_steps"] if s.get("module", "").startswith("layers.0.")]
    leaves = [(i, label.split(" · ")) for i, label in enumerate(labels) if " · " in label]
    assert [parts[:2] for _, parts in leaves] == [[m.rsplit(".", 1)[1], t] for m, t in zip(modules, types)]
    assert [label for label in labels if " · " not in label] == [
        "rotary ×2, scaled dot-product attention",
        "add",
        "SwiGLU",
        "add",
    ]
    node_of = {module: path[1 + i] for module, (i, _) in zip(modules, leaves, strict=True)}
    forward = [e for e in run["events"] if e["phase"] == "forward"]
    assert [(a, text) for a, _, text in chain if text] == [
        (node_of[e["module"]], f"all-reduce {i}, forward: {diagrams.human_bytes(e['nbytes'])} over NVLink")
        for i, e in enumerate(forward, start=1)
    ]
    backward = [e for e in run["events"] if e["phase"] == "backward"]
    assert sorted(dotted) == sorted(
        (node_of[e["module"]], f"backward: all-reduce of dX, {diagrams.human_bytes(e['nbytes'])}", before)
        for e in backward
        for before in [path[path.index(node_of[e["module"]]) - 1]]
    )


def test_fsdp_trace_prefetches_each_block_before_the_previous_unit_computes():
    trace = load_trace(NOTES, "fsdp_forward")
    assert forward_markers(trace) == [
        ("issue", "root"),
        ("issue", "layers.0"),
        ("start", "root"),
        ("issue", "layers.1"),
        ("start", "layers.0"),
        ("end", "layers.0"),
        ("start", "layers.1"),
        ("end", "layers.1"),
        ("end", "root"),
    ]
    gathered = [e["nbytes"] for e in trace["events"] if e["op"] == "all_gather" and e["phase"] == "forward"]
    assert gathered == [u["padded_numel"] * trace["dtype_size"] for u in trace["units"]]


def test_fsdp_trace_reduce_scatters_each_unit_from_its_own_hook_after_the_last_backward_flop():
    """What the synthesis page says of the recorded step: each reduce-scatter moves the unit whose backward span
    (pre- to post-backward hook) ended just before it, and all came after the last backward FLOP."""
    trace = load_trace(NOTES, "fsdp_forward")
    last_flop = max(s["flops_end"] for s in trace["spans"])
    ends = {s["name"].removesuffix(" backward"): s["end"] for s in trace["spans"] if s["phase"] == "backward"}
    scatters = [e for e in trace["events"] if e["op"] == "reduce_scatter"]
    assert sorted(e["module"] for e in scatters) == sorted(u["name"] for u in trace["units"])
    for e in scatters:
        assert e["flops"] == last_flop
        assert ends[e["module"]] <= e["start"] and not [
            u for u, end in ends.items() if ends[e["module"]] < end <= e["start"]
        ]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_pipeline_trace_records_the_schedule_its_peaks_and_b_s_h_e_per_message(schedule):
    trace = load_trace(NOTES, f"pipeline_{schedule}")
    p, m = trace["pp"], trace["m"]
    message = trace["b"] * trace["s"] * trace["h"] * trace["dtype_size"]
    assert [st["pp_rank"] for st in trace["stages"]] == list(range(p)) and m > p
    for r, stage in enumerate(trace["stages"]):
        assert stage["actions"] == textbook(schedule, p, r, m)
        assert len(stage["action_spans"]) == 2 * m and all(a <= b for a, b in stage["action_spans"])
        peak = m if schedule == "gpipe" else p - r
        assert stage["peak_in_flight"] == stage["peak_in_flight_measured"] == peak
        # m activations forward unless last, m gradients backward unless first; each message b*s*h*e bytes
        neighbours = (r > 0) + (r < p - 1)
        for op in ("send", "recv"):
            sizes = [e["nbytes"] for e in stage["p2p"] if e["op"] == op]
            assert sizes == [message] * (m * neighbours), (r, op)


def test_pipeline_timelines_idle_for_the_bubble_formula_and_1f1b_halves_stage_0_memory():
    gpipe, one_f_one_b = load_trace(NOTES, "pipeline_gpipe"), load_trace(NOTES, "pipeline_1f1b")
    p, m = gpipe["pp"], gpipe["m"]
    for trace in (gpipe, one_f_one_b):
        slots = pipeline_slots(trace)
        # the last backward of stage 0 ends after (m + p - 1) forward+backward slots: F 1, B 2
        assert max(stage[-1][2] for stage in slots) == 3 * (m + p - 1)
    numbers = estimates.pipeline_memory(gpipe, one_f_one_b, load_trace(NOTES, "scale_70b"))
    assert numbers.bubble == pytest.approx((p - 1) / (m + p - 1)) == pytest.approx(numbers.bubble_formula)
    assert numbers.gpipe_peaks == [m] * p and numbers.one_f_one_b_peaks == [p - r for r in range(p)]
    assert numbers.first_stage_bytes_ratio == p / m  # equal micro-batches: bytes follow the count
    assert numbers.message_bytes == numbers.formula_bytes
    setup = load_trace(NOTES, "scale_70b")["setup"]
    model = setup["model"]
    assert numbers.scale_message_bytes == model["micro_batch_size"] * model["seq_length"] * model["hidden_size"] * 2


@pytest.mark.parametrize("name", ["pipeline_gpipe", "pipeline_1f1b", "pipeline_interleaved"])
def test_each_recorded_order_with_equal_stages_idles_the_bubble_formula(name):
    """What the walkthrough prints beside (p - 1) / (v m + p - 1): the recorded orders replayed in slots."""
    trace = load_trace(NOTES, name)
    p, m, v = trace["pp"], trace["m"], trace["virtual_stages"]
    assert estimates.pipeline_bubble(trace) == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize("schedule", ZERO_BUBBLE_SCHEDULES)
def test_zero_bubble_traces_record_the_reference_orders_and_replay_to_their_bubble_formulas(schedule):
    """The walkthrough's zero-bubble tables and timelines: each rank ran reference.pipeline.zero_bubble's order
    (named as the meter names a chunk's actions), held what the order implies, and kept inputs for its W's; the
    orders replayed with F = I = W idle the formula the demo prints."""
    trace = load_trace(NOTES, f"pipeline_{schedule.replace('-', '_')}")
    p, m = trace["pp"], trace["m"]
    assert trace["v_shape"] == (schedule in V_SCHEDULES) and trace["layers"] % (2 * p) == 0
    for r, stage in enumerate(trace["stages"]):
        chunks = stages_of(schedule, p, r)
        names = [
            f"{a.kind}{a.micro_batch}" if len(chunks) == 1 else f"{a.kind}{chunks.index(a.stage)}.{a.micro_batch}"
            for a in flat(rank_order(schedule, p, r, m))
        ]
        assert stage["actions"] == names, r
        assert stage["peak_in_flight"] == stage["peak_in_flight_measured"] == peak_in_flight(schedule, p, r, m)
        assert stage["peak_weight_grad_bytes"] > 0
    assert estimates.pipeline_bubble(trace) == pytest.approx(bubble_formula(schedule, p, m))


def test_the_turn_of_the_v_costs_no_transfer_on_the_modeled_timeline():
    """Rank p - 1 holds stages p - 1 and p: its F1.0 follows its F0.0 at once, however slow the link, while
    rank 1's F0.0 waits for rank 0's message."""
    trace = load_trace(NOTES, "pipeline_zbv")
    rates = Rates(tflops=1, link_GBps=1e-3)
    at = {(bar.row, bar.label): bar for bar in pipeline_modeled(trace, rates)}
    last = f"stage {trace['pp'] - 1}"
    assert at[last, "F1.0"].start == at[last, "F0.0"].end
    message = trace["dtype_size"] * math.prod(trace["activation_shape"])
    assert at["stage 1", "F0.0"].start == pytest.approx(at["stage 0", "F0.0"].end + rates.transfer(message))


def test_pipeline_orders_that_wait_on_each_other_are_a_one_line_error(tmp_path):
    (tmp_path / "traces").mkdir()
    trace = json.loads((NOTES / "traces" / "pipeline_1f1b.json").read_text())
    last = trace["stages"][-1]["actions"]
    last[0], last[1] = last[1], last[0]  # B0 before F0 on the last stage: nothing can run
    (tmp_path / "traces" / "pipeline_1f1b.json").write_text(json.dumps(trace))
    with pytest.raises(diagrams.TraceError, match="wait on each other.*re-record with tools/record-traces"):
        diagrams.diagram(load_trace(tmp_path, "pipeline_1f1b"), tflops=1, link_GBps=25)


def test_estimates_follow_from_the_measured_numbers():
    tp = estimates.tp_crossover(load_trace(NOTES, "tp_block"), link_GBps=600, tflops=400, tp=8, bytes_per_element=2)
    assert tp.allreduce_bytes == tp.formula_bytes and tp.allreduces_per_block == 4
    # Per token and rank at TP=8, forward + backward (3x the forward): GEMMs 3 x 24 h^2 / 8 FLOPs, attention
    # 3 x 4 s h / 8; four all-reduces of 2(7/8) x 2h bytes (bf16). Equal times at h = (14 R/B - 1.5 s) / 9.
    s = load_trace(NOTES, "tp_block")["s"]
    assert tp.crossover_hidden == round((14 * 400e12 / 600e9 - 1.5 * s) / 9)
    fsdp = load_trace(NOTES, "fsdp_forward")  # the recorded run's parameter shards are the formula's 1/N
    shards = sum(u["padded_numel"] for u in fsdp["units"]) * fsdp["dtype_size"] // fsdp["world"]
    assert estimates.training_memory(fsdp["params"], world=fsdp["world"], sharded=True).params == shards


def test_memory_chart_is_drawn_from_the_formulas():
    """DDP holds 16 bytes per parameter on each rank, FSDP 1/world of it: a 16 GB GPU is full at 1B parameters
    under DDP and at 8B over 8 ranks; the chart's lines are those per-rank sizes and the GPU's flat line, and
    the legend says what the FSDP line leaves out (the gathered units)."""
    limit = estimates.sharding_limit(gpu_GB=16, world=8)
    assert (limit.ddp_max_billions, limit.fsdp_max_billions) == (1.0, 8.0)
    assert limit.billions == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert limit.ddp_GB == [16 * b for b in limit.billions] and limit.fsdp_GB == [2 * b for b in limit.billions]
    chart = diagrams.chart_training_memory(limit)
    assert chart.startswith("```mermaid\n%%{init: ") and "\nxychart-beta\n" in chart
    assert "red: DDP (every rank holds all 16 B per parameter) · " in chart
    # the FSDP line is the shards alone: the units gathered at the moment come on top, parameters and gradients
    assert "blue: FSDP over 8 ranks (16/8 B per parameter, plus about two units' gathered parameters and" in chart
    assert '  x-axis "parameters, billions (linear: equal steps)" ["0B", "1B", "2B", "3B", "4B", "5B", "6B"' in chart
    assert [line for line in chart.split("\n") if line.startswith("  line")] == [
        "  line [0, 16, 32, 48, 64, 80, 96, 112, 128]",
        "  line [0, 2, 4, 6, 8, 10, 12, 14, 16]",
        "  line [16, 16, 16, 16, 16, 16, 16, 16, 16]",
    ]


def test_memory_chart_spaces_model_sizes_linearly_so_a_linear_formula_draws_straight():
    """Finding: 0.25B, 0.5B ... 8B were spaced evenly on the x axis, so 16 B per parameter looked exponential.
    The categories step by equal amounts and the axis says linear: equal distances are equal parameters."""
    chart = diagrams.chart_training_memory(estimates.sharding_limit(gpu_GB=16, world=8))
    (axis,) = [line for line in chart.split("\n") if line.startswith("  x-axis")]
    assert "linear" in axis
    sizes = [float(x) for x in re.findall(r'"([\d.]+)B"', axis)]
    steps = {round(b - a, 9) for a, b in zip(sizes, sizes[1:])}
    assert len(sizes) >= 5 and len(steps) == 1 and sizes[0] == 0
    ddp = [float(v) for v in re.findall(r"[\d.]+", chart.split("\n  line [")[1].split("]")[0])]
    assert len({round(b - a, 6) for a, b in zip(ddp, ddp[1:])}) == 1  # a straight line


def test_dtensor_diagram_draws_each_linear_with_the_weight_rank_0_holds_and_the_recorded_all_reduces():
    trace = load_trace(NOTES, "dtensor_qwen2")
    drawn = diagrams.diagram(trace, link="NVLink")
    held = {w["name"]: w for w in trace["parameters"]}
    for module, style in [("self_attn.q_proj", "ColwiseParallel"), ("self_attn.o_proj", "RowwiseParallel")]:
        w = held[f"model.layers.0.{module}.weight"]
        shown = f"{module.split('.')[1]} · {style} · weight {w['local_shape'][0]} × {w['local_shape'][1]} of "
        assert shown + f"{w['shape'][0]} × {w['shape'][1]}, {w['placement']}" in drawn
    assert "input_layernorm · not in the plan" in drawn
    assert drawn.count("==>|") == 2 and drawn.count("-.->|") == 5  # Rowwise outputs forward, Colwise dX backward
    trace["collectives"] = [c for c in trace["collectives"] if c["phase"] != "backward"]
    with pytest.raises(diagrams.TraceError, match="once per ColwiseParallel input gradient backward"):
        diagrams.diagram(trace, link="NVLink")


def test_a_trace_the_recorder_cannot_draw_is_a_one_line_error(tmp_path):
    (tmp_path / "traces").mkdir()
    tp = json.loads((NOTES / "traces" / "tp_block.json").read_text())
    for run in tp["runs"]:
        run["events"] = [e for e in run["events"] if e["phase"] == "backward"]
    (tmp_path / "traces" / "tp_block.json").write_text(json.dumps(tp))
    fsdp = json.loads((NOTES / "traces" / "fsdp_forward.json").read_text())
    fsdp["spans"] = [s for s in fsdp["spans"] if s["name"] != "layers.1 forward"]
    (tmp_path / "traces" / "fsdp_forward.json").write_text(json.dumps(fsdp))
    cases = [
        ("tp_block", dict(link="NVLink"), "saw no tensor-parallel linear layer issuing the collectives"),
        (
            "fsdp_forward",
            dict(tflops=1, link_GBps=25),
            "no forward all-gather or compute span recorded for unit(s) layers.1",
        ),
    ]
    for name, options, message in cases:
        with pytest.raises(diagrams.TraceError) as error:
            diagrams.diagram(load_trace(tmp_path, name), **options)
        assert message in str(error.value) and "re-record with tools/record-traces" in str(error.value)
        assert "\n" not in str(error.value)
    with pytest.raises(diagrams.TraceError, match="no recorded trace 'nope' .*traces: fsdp_forward, tp_block"):
        load_trace(tmp_path, "nope")
    (tmp_path / "traces" / "bad.json").write_text('{"kind": "tp_block"}')
    with pytest.raises(diagrams.TraceError, match="tp_block trace lacks world, tp, s, b, heads"):
        load_trace(tmp_path, "bad")


def test_mermaid_labels_are_escaped():
    assert (
        diagrams.label('a "b" <script> #1 `x` | y; z')
        == '"a #quot;b#quot; #lt;script#gt; #35;1 #96;x#96; #124; y#59; z"'
    )
    assert diagrams.gantt_text("layers.0: 49 KiB #x") == "layers.0  49 KiB  x"


def test_record_traces_only_runs_the_launch_that_makes_the_named_trace_and_writes_just_it(tmp_path, monkeypatch):
    """`--only tp_block_llama` starts the two-rank worker launch alone (no pipeline, scale or activation-memory
    run) and leaves its other traces out of the output folder. The launch is stood in for: it writes the
    traces its WORKER_RUNS entry names (the fresh-run fixture above checks a real launch writes exactly those)."""
    launched = []

    def fake_run(cmd, what, timeout, **env):
        launched.append(what)
        scratch, group = cmd[-2], cmd[-1]
        for name in {w: names for _, w, names in record_traces.WORKER_RUNS}[group]:
            Path(scratch, f"{name}.json").write_text("{}")
        return ""

    monkeypatch.setattr(record_traces, "_run", fake_run)
    assert record_traces.main(["--out", str(tmp_path / "out"), "--only", "tp_block_llama"]) == 0
    assert launched == ["trace worker (tp_fsdp, 2 ranks)"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["tp_block_llama.json"]


def test_record_traces_only_refuses_an_unknown_trace_in_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        record_traces.main(["--only", "tp_block_gpt3"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and "argument --only: invalid choice: 'tp_block_gpt3'" in err[-1]
    assert "'tp_block_llama'" in err[-1]


def test_a_pipeline_of_thousands_of_stages_is_placed_in_linear_time():
    """Each action waits on one action of a neighbouring stage: placing them must not rescan every stage per
    action (12,000 stages once took 268 s). The time per stage is benchmarks/bench_pipeline_slots.py's figure;
    here, the slots of the first and the last stage."""
    p = 4000
    trace = {"name": "wide", "stages": [{"actions": ["F0", "B0"]} for _ in range(p)]}
    slots = pipeline_slots(trace)
    assert slots[p - 1] == [("F0", p - 1, p), ("B0", p, p + 2)]
    assert slots[0] == [("F0", 0, 1), ("B0", 3 * p - 2, 3 * p)]


@pytest.mark.parametrize(
    "text, refusal",
    [
        pytest.param("[" * 100_000 + "]" * 100_000, "nested", id="nested"),
        pytest.param('{"kind": "pipeline", "pad": "' + "x" * (17 << 20) + '"}', "larger than", id="huge"),
    ],
)
def test_a_trace_too_deep_or_too_large_is_a_one_line_error(tmp_path, text, refusal):
    (tmp_path / "traces").mkdir()
    (tmp_path / "traces" / "evil.json").write_text(text)
    with pytest.raises(diagrams.TraceError, match=refusal) as caught:
        load_trace(tmp_path, "evil")
    assert "\n" not in str(caught.value) and "evil.json" in str(caught.value)
