"""`torchrun --nproc-per-node 2 -m reference.hf_tp`: PyTorch DTensor's plan on Hugging Face's Qwen2, the demo of
the DTensor walkthrough (reading_notes/walkthrough-dtensor.md.j2).

Its counts are the closed form the walkthrough states (PER_BLOCK and per_step of test_qwen2_dtensor.py, which
counts the same plan its own way) at two depths, with and without sequence parallelism, and its bytes b·s·h
words a collective; its loss and gradients are the unsharded model's; the traces the worked example renders
(reading_notes/traces/dtensor_qwen2*.json, tools/record-traces) are a fresh run's. Bad input is one line, exit 2,
before any process group exists. The runs share one world-2 launch, in process; one real torchrun launch runs the
command end to end.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import sys

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from reference.hf_tp import plan
from reference.hf_tp.__main__ import main
from reference.measure.comm_bytes import CommBytes
from tests.evidence.test_qwen2_dtensor import PER_BLOCK, per_step
from tests.launch import ROOT, torchrun
from tests.ranks import on_ranks
from tests.reference.helpers import captured_stdout, json_lines, rank0
from tests.reference.refusals import refusal

TRACES = ROOT / "reading_notes" / "traces"
CONFIGS = {"tp": [], "sp": ["--sequence-parallel"]}
FP32 = 2e-6  # as test_qwen2_dtensor.py: fp32 sums in another order


def report(argv: list[str]) -> dict:
    """Rank 0's `--json` report of `torchrun -m reference.hf_tp ARGV`, run in this process on the launch's
    group (the demo runs on a group it finds set up and leaves it), on every rank."""
    with captured_stdout() as captured:
        main([*argv, "--device", "cpu", "--json"])
    return rank0(json_lines(captured.getvalue())[0] if captured.getvalue() else None)


@functools.cache
def runs() -> dict:
    """This rank's reports: each config at the default 2 layers and at 4, and a 7-token sequence without
    sequence parallelism and padded with it."""
    out = {(config, 2): report(args) for config, args in CONFIGS.items()}
    out |= {(config, 4): report([*args, "--num-layers", "4"]) for config, args in CONFIGS.items()}
    out["padded"] = report(["--sequence-parallel", "--seq-length", "7", "--pad-sequence"])
    out["seven"] = report(["--seq-length", "7"])
    return out


def counts(rows: list[dict], where: str) -> dict[str, dict[str, int]]:
    """{phase: {collective: count}} of one row of the report ("step": the whole step)."""
    return {
        phase: {r["kind"]: r["count"] for r in rows if r["where"] == where and r["phase"] == phase}
        for phase in ("forward", "backward")
    }


@pytest.mark.upstream("pytorch")
@on_ranks(2)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("layers", [2, 4])  # 4: the walkthrough's exercise 2
def test_counts_per_layer_and_per_step_are_the_walkthroughs_closed_form(ranks, config, layers):
    run = runs()[(config, layers)]
    assert run["config"]["layers"] == layers
    for i in range(layers):
        assert counts(run["collectives"], f"model.layers.{i}") == PER_BLOCK[config]
    assert counts(run["collectives"], "step") == per_step(config, layers)


@pytest.mark.upstream("pytorch")
@on_ranks(2)
@pytest.mark.parametrize("config", CONFIGS)
def test_each_layer_collective_carries_the_whole_activation_and_the_loss_one_word_a_token(ranks, config):
    """N = b·s·h·4 bytes for every collective of a decoder layer (an all-reduce's tensor, an all-gather's output,
    a reduce-scatter's input); loss_parallel's three all-reduces carry one fp32 word per token."""
    run = runs()[(config, 2)]
    c = run["config"]
    layer_rows = [r for r in run["collectives"] if r["where"].startswith("model.layers.")]
    assert {r["each"] for r in layer_rows} == {c["b"] * c["s"] * c["h"] * c["dtype_size"]}
    loss = [r for r in run["collectives"] if r["where"] == "loss_parallel"]
    assert [(r["kind"], r["count"], r["each"]) for r in loss] == [("all_reduce", 3, c["b"] * c["s"] * 4)]


@pytest.mark.upstream("pytorch")
@on_ranks(2)
@pytest.mark.parametrize("config", CONFIGS)
def test_loss_and_gradients_are_the_unsharded_models(ranks, config):
    run = runs()[(config, 2)]
    assert run["grads_equal"] and abs(run["loss"] - run["loss_unsharded"]) <= FP32
    norms = ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"]
    expected = [*norms, *(n.replace(".0.", ".1.") for n in norms), "model.norm.weight"] if config == "sp" else []
    assert run["partial_grads"] == expected


@pytest.mark.upstream("pytorch")
@on_ranks(2)
def test_a_sequence_padded_to_a_multiple_of_p_gives_the_unpadded_loss(ranks):
    run = runs()["padded"]
    assert (run["config"]["s"], run["padded_s"]) == (7, 8)
    assert run["grads_equal"] and abs(run["loss"] - run["loss_unsharded"]) <= FP32


@pytest.mark.upstream("pytorch")
@on_ranks(2)
def test_without_sequence_parallelism_7_tokens_run_unpadded_and_give_the_padded_runs_loss(ranks):
    """The walkthrough's exercise 3: without SP nothing is split by token, so 7 tokens run as they are, a layer's
    collectives carry b·7·h·4 bytes and loss_parallel's b·7·4; the loss is the one the padded SP run prints."""
    seven, padded = runs()["seven"], runs()["padded"]
    c = seven["config"]
    assert (c["s"], seven["padded_s"]) == (7, 7)
    layer_rows = [r for r in seven["collectives"] if r["where"].startswith("model.layers.")]
    assert {r["each"] for r in layer_rows} == {c["b"] * 7 * c["h"] * c["dtype_size"]}
    assert [r["each"] for r in seven["collectives"] if r["where"] == "loss_parallel"] == [c["b"] * 7 * 4]
    assert seven["grads_equal"] and seven["loss"] == pytest.approx(padded["loss"], abs=FP32)


@pytest.mark.upstream("pytorch")
@on_ranks(2)
def test_weights_split_as_the_walkthrough_says(ranks):
    """Column layers keep 1/p of the rows (Shard(0), their biases too), row layers 1/p of the columns
    (Shard(1)), the embedding and head 1/p of the vocabulary; the norms stay plain, or Replicate under SP."""
    for config in CONFIGS:
        params = {r["name"]: r for r in runs()[(config, 2)]["parameters"]}
        for name, r in params.items():
            kind = name.split(".")[-2]
            if kind in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"):
                assert (r["placement"], r["local_shape"][0] * 2) == ("Shard(0)", r["shape"][0]), name
            elif kind in ("o_proj", "down_proj"):
                assert (r["placement"], r["local_shape"][1] * 2) == ("Shard(1)", r["shape"][1]), name
            else:
                assert kind.endswith("norm") and r["local_shape"] == r["shape"], name
                assert r["placement"] == ("Replicate()" if config == "sp" else "plain"), name


@pytest.mark.freshness
@pytest.mark.upstream("pytorch")
@on_ranks(2)
@pytest.mark.parametrize("name, config", [("dtensor_qwen2", "tp"), ("dtensor_qwen2_sp", "sp")])
def test_committed_trace_is_a_fresh_run(ranks, name, config):
    committed = json.loads((TRACES / f"{name}.json").read_text())
    fresh = dict(runs()[(config, 2)])
    for key in ("loss", "loss_unsharded"):
        assert fresh.pop(key) == pytest.approx(committed.pop(key), abs=FP32), key
    assert fresh == committed, f"reading_notes/traces/{name}.json is stale: re-record with tools/record-traces"


@pytest.mark.upstream("pytorch")
@on_ranks(2)
def test_the_head_declared_sequence_sharded_needs_one_backward_collective_instead_of_five(ranks):
    """Under SP the document's head, `ColwiseParallel(use_local_output=False)`, declares its input Replicate
    (the default) while the final SequenceParallel norm hands it a Shard(1) DTensor: DTensor reconciles them op by
    op, and the head and the final norm's backward issue 5 collectives, as the walkthrough's exercise 1 names
    them: the head gathers its saved input again (N); the norm's backward reduce-scatters the Partial gradient
    twice (N each), gathers its saved 1/rms (b·s·4 bytes), and reduce-scatters the still-Partial direct term (N).
    Declared `input_layouts=Shard(1)`, the same forward all-gather, one reduce-scatter backward, and the same
    loss."""
    mesh = init_device_mesh("cpu", (2,))
    base = plan.build(plan.tiny_config(), 0)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    labels, positions = plan.shift_labels(ids), torch.arange(8).unsqueeze(0)

    def outside_layers(head) -> tuple[list[tuple[str, str]], float]:
        model = copy.deepcopy(base)
        for layer in model.model.layers:
            parallelize_module(layer, mesh, plan.block_plan(sequence_parallel=True))
        parallelize_module(model, mesh, plan.top_plan(sequence_parallel=True) | {"lm_head": head})
        with CommBytes() as comm:
            loss = plan.loss_and_backward(model, ids, labels, positions)
        rows = [c for c in comm.counted if re.search(r"lm_head|model\.norm$", c.module)]
        return [(c.phase, c.kind, c.module.split(".", 1)[1], c.nbytes) for c in rows], loss.item()

    document, loss = outside_layers(ColwiseParallel(use_local_output=False))
    declared, declared_loss = outside_layers(ColwiseParallel(input_layouts=Shard(1), use_local_output=False))
    n, token = 4 * 8 * 32 * 4, 4 * 8 * 4  # N = b·s·h·4 bytes; one fp32 word per token
    assert [row[1:] for row in document if row[0] == "backward"] == [
        ("all_gather", "lm_head", n),
        ("reduce_scatter", "model.norm", n),
        ("reduce_scatter", "model.norm", n),
        ("all_gather", "model.norm", token),
        ("reduce_scatter", "model.norm", n),
    ]
    assert [row[:2] for row in declared] == [("forward", "all_gather"), ("backward", "reduce_scatter")]
    assert [row[1] for row in document if row[0] == "forward"] == ["all_gather"]
    assert declared_loss == pytest.approx(loss, abs=FP32)


@pytest.mark.upstream("pytorch")
def test_the_command_runs_end_to_end_and_prints_the_counts():
    """The real `torchrun --nproc-per-node 2 -m reference.hf_tp --device cpu`, as the walkthrough runs it; its
    stderr holds no warning of the hooks CommDebugMode sets to measure (the walkthrough names torchrun's alone)."""
    out = torchrun("reference.hf_tp", 2, "--device", "cpu", module=True, timeout=240)
    assert "UserWarning" not in out, out
    n = 4 * 8 * 32 * 4  # b·s·h·4 bytes
    for i in range(2):
        assert re.search(
            rf"model\.layers\.{i} +forward +all_reduce 2 x {n:,} B\n +backward +all_reduce 5 x {n:,} B", out
        )
    assert re.search(r"the whole step +forward +all_reduce 8 \(.*\n +backward +all_reduce 11 x", out)
    assert re.search(r"gradients equal within", out)


@pytest.fixture
def launched(monkeypatch):
    """As torchrun starts rank 0 of `world` ranks, without a process group yet."""

    def at(world: int) -> None:
        for name, value in {"RANK": "0", "WORLD_SIZE": str(world), "LOCAL_RANK": "0"}.items():
            monkeypatch.setenv(name, value)

    return at


@pytest.mark.parametrize(
    "world, args, message",
    [
        (3, [], "3 ranks cannot split the model's 2 key/value heads"),
        (4, [], "4 ranks cannot split the model's 2 key/value heads"),
        (
            2,
            ["--sequence-parallel", "--seq-length", "7"],
            "sequence length 7 is not divisible by the 2 ranks: SequenceParallel takes each rank's 4 or 3 tokens as "
            "an even shard, unchecked, and the next all-gather's sizes disagree (gloo aborts the job); pass "
            "--pad-sequence to pad it to 8, or use a multiple of 2",
        ),
    ],
)
def test_what_the_plan_cannot_split_is_refused_in_one_line(launched, world, args, message, capsys):
    launched(world)
    err = refusal(main, args, capsys)
    assert err.startswith(f"reference.hf_tp: error: {message}") and err.count("\n") == 1, err


@pytest.mark.parametrize("args", [["--num-layers", "0"], ["--seq-length", "129"], ["--micro-batch-size", "x"]])
def test_bad_sizes_are_refused_in_one_line(launched, args, capsys):
    launched(2)
    err = refusal(main, args, capsys)
    assert err.startswith("torchrun --nproc-per-node N -m reference.hf_tp: error: argument") and err.count("\n") == 1


def test_outside_torchrun_it_says_how_to_launch(monkeypatch, capsys):
    monkeypatch.delenv("RANK", raising=False)
    err = refusal(main, [], capsys)
    assert err == (
        "reference.hf_tp: error: run under torchrun, e.g. .venv/bin/torchrun --standalone --nproc-per-node 2 "
        "-m reference.hf_tp\n"
    )


def test_without_transformers_it_says_how_to_install_it(launched, monkeypatch, capsys):
    launched(2)
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails as if not installed
    monkeypatch.delitem(sys.modules, "reference.hf_tp.plan")  # imported again, so it imports transformers again
    err = refusal(main, [], capsys)
    assert err == (
        "reference.hf_tp: error: needs Hugging Face transformers, which is not installed: `make setup` installs "
        "it with the test extras (or: .venv/bin/python -m pip install transformers)\n"
    )
