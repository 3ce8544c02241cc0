"""`torchrun -m reference --moe --ep E [--tp T]`: one-line refusals, and on 2 and 4 ranks (EP 2, EP 2 x TP 2) a
loss per step equal to the unsharded MoE layer trained in one process on every rank's tokens, and every rank's
recorded all-to-all bytes equal to the closed form it prints."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from reference.__main__ import main
from reference.moe.demo import synthetic_tokens
from reference.moe.layer import MoELayer
from tests.ranks import on_ranks
from tests.reference.helpers import demo_output
from tests.reference.refusals import refusal

ARGS = ["--hidden-size", "16", "--seq-length", "8", "--batch-size", "2", "--steps", "2", "--seed", "3"]
ARGS += ["--num-experts", "4", "--moe-aux-loss-coeff", "0", "--lr", "0.5", "--json"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--ep", "2"], "the data-parallel size (1) is not divisible by the expert-parallel size (2)"),
        (["--moe-router-topk", "9"], "--moe-router-topk 9 must be between 1 and --num-experts 8"),
        (["--pp", "2"], "--moe runs one MoE layer: no --pp and no --fsdp"),
    ],
)
def test_bad_moe_sizes_are_refused_with_one_line(args, message, capsys, monkeypatch):
    monkeypatch.setitem(os.environ, "WORLD_SIZE", "2" if "--pp" in args else "1")
    stderr = refusal(main, ["--moe", *args], capsys)
    assert stderr.strip() == f"reference: error: {message}", stderr


def unsharded_losses(world: int, tp: int) -> list[float]:
    """The plain layer, same seed, one SGD step per step on the mean of every rank's loss (its replica's slice)."""
    torch.manual_seed(3)
    layer = MoELayer(16, 32, 4, 2, aux_loss_coeff=0.0)
    teacher = torch.randn(16, 16, generator=torch.Generator().manual_seed(4)) / 16**0.5
    args = type("Args", (), {"seed": 3, "seq_length": 8, "batch_size": 2, "hidden_size": 16})
    optimizer, losses = torch.optim.SGD(layer.parameters(), lr=0.5), []
    for step in (1, 2):
        per_rank = [
            F.mse_loss(layer(x), y)
            for x, y in (
                synthetic_tokens(args, step, r // tp, teacher, r % tp, tp, "cpu", torch.float32) for r in range(world)
            )
        ]
        (sum(per_rank) / world).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(sum(loss.item() for loss in per_rank) / world)
    return losses


@on_ranks(2, 4)
def test_moe_demo_trains_like_the_unsharded_layer_and_sends_the_closed_form_bytes(ranks):
    tp = ranks.world // 2
    steps = [json.loads(line) for line in demo_output(["--moe", "--ep", "2", "--tp", str(tp), *ARGS]).splitlines()]
    if ranks.rank != 0:
        return
    assert [s["step"] for s in steps] == [1, 2]
    for got, expected in zip([s["loss"] for s in steps], unsharded_losses(ranks.world, tp)):
        assert got == pytest.approx(expected, rel=1e-5)
    for s in steps:
        assert s["dropped"] == 0 and sum(s["pairs_per_expert"]) == s["tokens"] * 2
        assert all(r["a2a_bytes"] == r["closed_form"] > 0 for r in s["ranks"]), s["ranks"]
