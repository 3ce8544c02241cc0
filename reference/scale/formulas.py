"""Closed-form bytes and counts of one training step's collectives, per group and collective type, for the
rank at pipeline stage `stage` of a ScaleSetup. What reference.scale.simulate measures must equal these.

Symbols: m micro-batches, L layers per stage, t/p/d the TP/PP/DP sizes, b s h f the micro-batch, sequence,
hidden and FFN sizes, V_p the padded vocabulary, e the bytes per element (bf16: 2). Bytes follow the
recorder's convention (reference.recorder): the full tensor, i.e. an all-gather counts the gathered output
and a reduce-scatter the unreduced input. A = b s h e, one activation. Per micro-batch:

  TP, no SP: all-reduce A per block twice forward (attention out, fc2: the g regions) and twice backward
      (fc1 and QKV input grads: the f regions); the vocab-parallel embedding all-reduces its output (A);
      the LM head's column layer all-reduces its input grad (A); the loss all-reduces max, target logit and
      exp-sum, one fp32 number per token each (3 x 4 b s).
  TP, SP: each block's all-reduces become all-gathers and reduce-scatters of A: forward 2 + 2, backward
      4 all-gathers (2 input re-gathers for the weight grads, 2 grads of the reduce-scatters) + 2
      reduce-scatters; the embedding reduce-scatters (backward: all-gathers); the LM head all-gathers its
      input forward and backward and reduce-scatters its input grad. Once per step, the grads of the
      replicated LayerNorm weights and row biases (6 h per block, 2 h for the final LayerNorm) are
      all-reduced over TP (megatron/core/distributed/finalize_model_grads.py::
      _allreduce_non_tensor_model_parallel_grads).
  PP: every stage but the last sends its output forward and receives its gradient back, every stage but the
      first receives its input and sends its input grad: A, or A / t under SP (Megatron sends the sequence
      shard: megatron/core/pipeline_parallel/schedules.py::get_tensor_shapes).
  DP, once per step, over the P parameters this rank holds: DDP all-reduces an fp32 gradient buffer (4 P;
      Megatron-LM reduces in fp32 for bf16 runs, megatron/core/distributed/param_and_grad_buffer.py::
      _ParamAndGradBucketGroup.start_grad_sync); the distributed optimizer reduce-scatters it instead and
      all-gathers the updated bf16 parameters (e P), both over the buffer padded to lcm(d, 128) elements
      (param_and_grad_buffer.py::_ParamAndGradBuffer, _pad_end_of_bucket_if_needed), as one bucket.
"""
from __future__ import annotations

import dataclasses
import math

from reference.scale.shapes import ScaleSetup

FP32 = 4


@dataclasses.dataclass(frozen=True)
class Term:
    """One source of traffic in a (group, op) row: how many collectives, how many bytes, and why."""
    count: int
    nbytes: int
    formula: str


def stage_params(setup: ScaleSetup, stage: int) -> int:
    """Parameters held by one TP rank of pipeline stage `stage` (the blocks of reference.tensor_parallel)."""
    m, t = setup.model, setup.tp
    h, f = m.hidden_size, m.ffn_hidden_size
    # two LayerNorms (4h), QKV (3h^2/t + 3h/t), attention out (h^2/t + h), fc1 (hf/t + f/t), fc2 (hf/t + h)
    block = 4 * h + (3 * h * h + 3 * h) // t + h * h // t + h + (h * f + f) // t + h * f // t + h
    total = setup.layers_per_stage * block
    if stage == 0:
        total += setup.padded_vocab_size // t * h                  # embedding rows
    if stage == setup.pp - 1:
        total += 2 * h + setup.padded_vocab_size // t * h          # final LayerNorm, output layer rows
    return total


def sequence_parallel_params(setup: ScaleSetup, stage: int) -> int:
    """Replicated parameters that see only this rank's tokens under SP: LayerNorms and row-parallel biases."""
    h = setup.model.hidden_size
    return setup.layers_per_stage * 6 * h + (2 * h if stage == setup.pp - 1 else 0)


def padded_buffer(numel: int, dp: int) -> int:
    """The gradient buffer padded for even sharding over dp (Megatron: a multiple of lcm(dp, 128))."""
    divisor = math.lcm(dp, 128)
    return -(-numel // divisor) * divisor


def expected(setup: ScaleSetup, stage: int) -> dict[tuple[str, str], list[Term]]:
    """{(group, op): [Term, ...]} for a rank at pipeline stage `stage`; groups "tp", "pp", "dp"."""
    model, mb, L, e = setup.model, setup.microbatches, setup.layers_per_stage, setup.dtype_bytes
    first, last = stage == 0, stage == setup.pp - 1
    act = model.micro_batch_size * model.seq_length * model.hidden_size * e
    loss = model.micro_batch_size * model.seq_length * FP32
    rows: dict[tuple[str, str], list[Term]] = {}

    def add(group, op, count, nbytes, formula):
        rows.setdefault((group, op), []).append(Term(count, count * nbytes, formula))

    if setup.tp > 1 and not setup.sp:
        add("tp", "all_reduce", 4 * mb * L, act, "4 m L x bshe (blocks: 2 fwd, 2 bwd)")
        if first:
            add("tp", "all_reduce", mb, act, "m x bshe (embedding)")
        if last:
            add("tp", "all_reduce", mb, act, "m x bshe (LM head input grad)")
            add("tp", "all_reduce", 3 * mb, loss, "3 m x 4bs (loss: max, target, sum-exp)")
    if setup.tp > 1 and setup.sp:
        add("tp", "all_gather", 6 * mb * L, act, "6 m L x bshe (blocks: 2 fwd, 4 bwd)")
        add("tp", "reduce_scatter", 4 * mb * L, act, "4 m L x bshe (blocks: 2 fwd, 2 bwd)")
        if first:
            add("tp", "reduce_scatter", mb, act, "m x bshe (embedding)")
            add("tp", "all_gather", mb, act, "m x bshe (embedding grad)")
        if last:
            add("tp", "all_gather", 2 * mb, act, "2 m x bshe (LM head input, fwd and bwd)")
            add("tp", "reduce_scatter", mb, act, "m x bshe (LM head input grad)")
            add("tp", "all_reduce", 3 * mb, loss, "3 m x 4bs (loss: max, target, sum-exp)")
        add("tp", "all_reduce", 1, sequence_parallel_params(setup, stage) * e,
            "1 x (6hL" + (" + 2h" if last else "") + ")e (SP LayerNorm + bias grads)")
    if setup.pp > 1:
        shard = act // setup.tp if setup.sp else act
        what = "bshe/t" if setup.sp else "bshe"
        for op, direction_first, direction_last in (("send", "activations", "input grads"),
                                                    ("recv", "output grads", "activations")):
            if not last:
                add("pp", op, mb, shard, f"m x {what} ({direction_first})")
            if not first:
                add("pp", op, mb, shard, f"m x {what} ({direction_last})")
    if setup.dp > 1:
        params = stage_params(setup, stage)
        if setup.dp_mode == "allreduce":
            add("dp", "all_reduce", 1, params * FP32, "1 x 4P (fp32 grads)")
        else:
            padded = padded_buffer(params, setup.dp)
            add("dp", "reduce_scatter", 1, padded * FP32, "1 x 4P' (fp32 grads, P' padded)")
            add("dp", "all_gather", 1, padded * e, "1 x eP' (params)")
    return rows


def totals(terms: list[Term]) -> tuple[int, int]:
    """(count, bytes) of a row."""
    return sum(t.count for t in terms), sum(t.nbytes for t in terms)
