"""Activation recomputation (reference.recompute): selective and full recomputation give the gradients of no
recomputation bit for bit, because the recomputed dropout masks are the same; an unknown mode is one line."""

import functools

import pytest
import torch
import torch.distributed as dist

import reference.recompute
from reference.__main__ import main
from reference.gpt.model import gpt_blocks
from reference.parallel_state import ParallelConfigError
from reference.recompute import RECOMPUTE_MODES, check_mode
from reference.tensor_parallel.parallelize import parallelize, parallelize_block
from reference.tensor_parallel.rotary import rotary_cos_sin
from reference.tensor_parallel.transformer import LlamaBlock
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import demo_output, json_lines, max_diff
from tests.reference.refusals import refusal

S, B, H, A, LAYERS, SEED, STEPS, DROPOUT = 8, 2, 16, 4, 2, 11, 2, 0.25


def train(device, tp_group, sequence_parallel: bool, recompute: str, dtype) -> tuple[list[float], dict]:
    """Losses and this rank's parameter and input gradients after STEPS forward-backward passes of a two-block
    parallelized stage of GPT blocks with dropout."""
    torch.manual_seed(SEED)
    model = parallelize(
        gpt_blocks(LAYERS, H, A, hidden_dropout=DROPOUT, attention_dropout=DROPOUT, params_dtype=dtype, device=device),
        tp_group,
        dropout_seed=SEED,
        sequence_parallel=sequence_parallel,
        recompute=recompute,
    )
    losses, grads = [], {}
    for step in range(STEPS):
        x = torch.randn(S, B, H, device=device, dtype=dtype, requires_grad=True)
        weights = torch.randn(S, B, H, device=device, dtype=dtype)
        loss = (model(None, None, hidden=x) * weights).sum()
        loss.backward()
        losses.append(loss.item())
        grads[f"step{step}.input"] = x.grad
    grads.update({name: p.grad for name, p in model.named_parameters()})
    return losses, grads


def compare(reference_run, run) -> dict:
    (losses0, grads0), (losses, grads) = reference_run, run
    return {
        "losses_equal": losses == losses0,
        "grads_equal": all(torch.equal(grads[n], grads0[n]) for n in grads0),
        "max_grad_diff": max_diff(grads, grads0),
    }


@functools.cache
def layouts(device: torch.device) -> dict:
    """{layout: {mode or control: comparison with recompute "none"}} at t = the world size, fp32 and bf16 (and at
    t > 1 with and without SP). The control recomputes the attention core without restoring the TP dropout
    stream, to show that restoring it is what makes the gradients equal."""
    results, tp_group = {}, dist.group.WORLD
    for dtype in (torch.float32, torch.bfloat16):
        for sp in [False, True] if tp_group.size() > 1 else [False]:
            name = f"t{tp_group.size()}{'_sp' if sp else ''}_{str(dtype).removeprefix('torch.')}"
            baseline = train(device, tp_group, sp, "none", dtype)
            results[name] = {
                mode: compare(baseline, train(device, tp_group, sp, mode, dtype)) for mode in RECOMPUTE_MODES[1:]
            }
            replaying = reference.recompute._replaying
            reference.recompute._replaying = lambda function, rng: function  # the control: no TP stream replay
            try:
                results[name]["selective_without_tp_stream_replay"] = compare(
                    baseline, train(device, tp_group, sp, "selective", dtype)
                )
            finally:
                reference.recompute._replaying = replaying
    return results


@on_ranks(1, 2, devices=DEVICES)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_losses_and_gradients_of_none_bit_for_bit(ranks, mode):
    assert len(layouts(ranks.device)) == (2 if ranks.world == 1 else 4)  # fp32 and bf16; at t 2 also with SP
    for layout, modes in layouts(ranks.device).items():
        assert modes[mode] == {"losses_equal": True, "grads_equal": True, "max_grad_diff": 0.0}, layout


@on_ranks(1, 2, devices=DEVICES)
def test_without_restoring_the_tp_dropout_stream_the_recomputed_masks_differ(ranks):
    """The control: recomputing the attention core from wherever the per-TP-rank stream has moved on to draws
    other attention-dropout masks, so restoring that stream is what makes the gradients equal."""
    for layout, modes in layouts(ranks.device).items():
        control = modes["selective_without_tp_stream_replay"]
        assert not control["grads_equal"] and control["max_grad_diff"] > 1e-3, layout


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_a_llama_block_built_without_a_stream_recomputes_with_its_own(one_rank_gloo, mode):
    """A Llama block split without `rng` (as a user may split it) recomputes on the stream parallelize_block
    made for it, attention core included, and gives the gradients of no recomputation bit for bit."""

    def gradients(recompute: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = LlamaBlock(16, 4, num_kv_heads=2, ffn_hidden_size=24, norm_eps=1e-5)
        parallelize_block(block, dist.group.WORLD, recompute=recompute)
        x = torch.randn(6, 2, 16, requires_grad=True)
        block(x, *rotary_cos_sin(6, 4, 10000.0)).square().sum().backward()
        return [x.grad, *(p.grad for p in block.parameters())]

    expected = gradients("none")
    assert all(torch.equal(a, b) for a, b in zip(gradients(mode), expected, strict=True))


def test_an_unknown_mode_is_refused_with_the_choices():
    with pytest.raises(ParallelConfigError) as error:
        check_mode("partial")
    assert str(error.value) == "unknown recompute mode 'partial'; choose one of none, selective, full"


def test_the_demo_refuses_an_unknown_recompute_mode_in_one_line(capsys):
    stderr = refusal(main, ["--recompute", "partial"], capsys)
    assert stderr.count("\n") == 1, stderr
    assert "argument --recompute: invalid choice: 'partial'" in stderr


MODES = ("none", "selective", "full")


def gpt_args(recompute: str) -> list[str]:
    return [
        "--json",
        "--steps",
        "2",
        "--dropout",
        "0.2",
        "--recompute",
        recompute,
        "--hidden-size",
        "16",
        "--seq-length",
        "8",
        "--vocab-size",
        "32",
        "--micro-batches",
        "2",
    ]


def llama_args(recompute: str) -> list[str]:
    return [
        "--json",
        "--model",
        "llama",
        "--steps",
        "2",
        "--recompute",
        recompute,
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "16",
        "--vocab-size",
        "64",
        "--micro-batches",
        "2",
    ]


@functools.cache
def _demo_records() -> dict[tuple[str, str], list[dict]]:
    """{(model, recompute mode): --json records} of every world-1 demo run of this file (once a rank)."""
    runs = {("gpt2", mode): gpt_args(mode) for mode in MODES} | {("llama", mode): llama_args(mode) for mode in MODES}
    return {run: json_lines(demo_output(argv)) for run, argv in runs.items()}


def _demo_losses(recompute: str) -> list[float]:
    return [record["loss"] for record in _demo_records()["gpt2", recompute] if "step" in record]


@on_ranks(1)
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_the_demo_trains_the_same_with_recomputation(ranks, mode):
    """--recompute through the GPT stage and the pipeline step: the same losses as without, with dropout."""
    losses = _demo_losses(mode)
    assert len(losses) == 2 and losses == _demo_losses("none")


def _llama_demo(recompute: str) -> tuple[list[float], int, list[int]]:
    """(losses, peak activation bytes, FLOPs of each action) of the Llama/Qwen2 block's demo at world 1."""
    lines = _demo_records()["llama", recompute]
    losses = [line["loss"] for line in lines if "step" in line]
    pipeline = [line["pipeline"][0] for line in lines if "pipeline" in line][-1]
    memory = [line["memory"][0] for line in lines if "memory" in line][-1]
    return losses, memory["peak_activation_bytes"], pipeline["action_flops"]


@on_ranks(1)
def test_the_llama_block_recomputes_too(ranks):
    """The modern block takes the same modes: the same losses, fewer activation bytes kept (full keeps only the
    block inputs), and under full recompute a backward that does the forward's linear-layer FLOPs again (the
    recorder counts matmuls of the linear layers, so selective recompute of the attention core adds none)."""
    losses, kept, flops = _llama_demo("none")
    selective, full = _llama_demo("selective"), _llama_demo("full")
    assert len(losses) == 2 and selective[0] == losses and full[0] == losses
    assert full[1] < selective[1] < kept
    assert selective[2][0::2] == full[2][0::2] == flops[0::2]  # forwards: unchanged
    assert selective[2][1::2] == flops[1::2]
    extra = [b - n for b, n in zip(full[2][1::2], flops[1::2])]
    assert all(0 < e < f for e, f in zip(extra, flops[0::2]))  # full: the blocks' forward again, not the head's
