"""The backward in two (I, then W) equals the one-pass backward exactly, and the zero-bubble schedules train
exactly as 1F1B does. Orders against torch's own schedules: tests/evidence/test_zero_bubble_orders_upstream.py."""

from __future__ import annotations

import torch
import torch.distributed as dist

from reference.gpt.model import GPT, GPTConfig
from reference.gpt.parallelize import parallelize_gpt
from reference.gpt.train import split_batch, synthetic_batches
from reference.parallel_state import build_layout
from reference.pipeline.steps import Steps
from tests.ranks import on_ranks
from tests.reference.helpers import groups_of_the_block

CONFIG = GPTConfig(vocab_size=51, hidden_size=16, num_attention_heads=4, num_layers=4, seq_length=8)
SEED = 1234


def _stage_grads(layers, sp: bool, split: bool, m: int = 3) -> tuple[dict, list, int]:
    """One TP-2 stage's parameter gradients and input gradients after m micro-batches, backward in one pass
    or as every I then every W (the order that holds the most); with the bytes the W's held at their peak."""
    layout = build_layout(2, 1, 1)
    stage = parallelize_gpt(GPT(CONFIG, SEED, layers=layers), layout.tp_group, sequence_parallel=sp, seed=SEED)
    tokens = synthetic_batches(CONFIG, 1, m, SEED)[0]
    micro_batches = split_batch(tokens, 1, 0, m)
    generator = torch.Generator().manual_seed(SEED)
    hiddens = [
        None if stage.is_first else torch.randn(stage.activation_shape(1), generator=generator).requires_grad_()
        for _ in range(m)
    ]
    steps = Steps([stage], micro_batches, is_last=stage.is_last)
    outputs = [steps.forward(i, hiddens[i]) for i in range(m)]
    grads = [None if stage.is_last else torch.randn(o.shape, generator=generator) for o in outputs]
    if not split:
        input_grads = [steps.backward(i, hiddens[i], outputs[i], grads[i]) for i in range(m)]
        return {n: p.grad.clone() for n, p in stage.named_parameters()}, input_grads, 0
    input_grads = [steps.backward_input(i, hiddens[i], outputs[i], grads[i]) for i in range(m)]
    held = steps.weight_grads.held_bytes
    linear_weights = [n for n, p in stage.named_parameters() if p.grad is None]
    assert linear_weights and all("norm" not in n for n in linear_weights), linear_weights  # W's share, not yet run
    for i in range(m):
        steps.backward_weight(i)
    assert steps.weight_grads.held_tensors == steps.weight_grads.held_bytes == 0
    return {n: p.grad.clone() for n, p in stage.named_parameters()}, input_grads, held


@on_ranks(2)
def test_backward_input_then_weight_equals_the_one_pass_backward_at_tp2(ranks):
    """Every parameter gradient and input gradient of a TP-2 GPT stage (with and without SP; the whole model,
    and a middle stage taking a hidden input) is bitwise the one-pass backward's, and W let go of all it held."""
    for layers in ((0, CONFIG.num_layers), (1, 3)):
        for sp in (False, True):
            with groups_of_the_block():
                one_pass, one_pass_inputs, _ = _stage_grads(layers, sp, split=False)
                split, split_inputs, held = _stage_grads(layers, sp, split=True)
            assert one_pass.keys() == split.keys()
            for name, grad in one_pass.items():
                assert torch.equal(grad, split[name]), (layers, sp, name, (grad - split[name]).abs().max())
            for a, b in zip(one_pass_inputs, split_inputs):
                assert (a is None and b is None) or torch.equal(a, b), (layers, sp)
            assert held > 0, (layers, sp)
    dist.barrier()
