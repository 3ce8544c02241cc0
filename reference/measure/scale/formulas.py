"""Closed-form bytes and counts of one training step's collectives, per group and collective type, for the
rank at pipeline stage `stage` of a ScaleSetup. What reference.measure.scale.simulate measures must equal these.

The step is reference.gpt.train.train_step: the schedule (GPipe or 1F1B: the same transfers in another
order), then finalize_model_grads, then the optimizer step (no collective). Under interleaving (v model
chunks per stage, virtual stage c p + r for chunk c of stage r) the TP traffic per layer is unchanged, each
chunk sends and receives as a stage of a p v-stage pipeline would, and each chunk is a DDP of its own.

Symbols: m micro-batches, L layers on the stage (reference.gpt.model.split_layers: the first num_layers mod p
stages take one more), t/p/d the TP/PP/DP sizes, b s h f the micro-batch, sequence, hidden and FFN sizes, V_p
the padded vocabulary, e the bytes per element (bf16: 2). Bytes follow the recorder's convention
(reference.measure.recorder): the full tensor, i.e. an all-gather counts the gathered output and a reduce-scatter the
unreduced input. A = b s h e, one activation. Per micro-batch:

  TP, no SP: all-reduce A per block twice forward (attention out, fc2: the g regions) and twice backward
      (fc1 and QKV input grads: the f regions); the vocab-parallel embedding all-reduces its output (A);
      the LM head's column layer all-reduces its input grad (A); the loss all-reduces max, target logit and
      exp-sum, one fp32 number per token each (3 x 4 b s).
  TP, SP: each block's all-reduces become all-gathers and reduce-scatters of A: forward 2 + 2, backward
      4 all-gathers (2 input re-gathers for the weight grads, 2 grads of the reduce-scatters) + 2
      reduce-scatters. The first stage still all-reduces the embedding (the position embedding is added to
      the full sequence) and then splits it, an all-gather of its gradient in backward, as Megatron's
      LanguageModelEmbedding with learned positions. The LM head all-gathers its input forward and backward
      and reduce-scatters its input grad. Once per step, the grads of the replicated LayerNorm weights and
      row biases (6 h per block, 2 h for the final LayerNorm) are all-reduced over TP in one flat tensor
      (reference.data_parallel.finalize_model_grads, as megatron/core/distributed/finalize_model_grads.py::
      _allreduce_non_tensor_model_parallel_grads).
  PP: every stage but the last sends its output forward and receives its gradient back, every stage but the
      first receives its input and sends its input grad: A, or A / t under SP (Megatron sends the sequence
      shard: megatron/core/pipeline_parallel/schedules.py::get_tensor_shapes). Two barriers per step frame
      the schedule to measure its bubble (reference.measure.pipeline_meter; Megatron has none). With v chunks,
      each of the m v chunk-forwards does the same except the model's first and last: m (v - 1) transfers
      each way on the first and last stage, m v on the others.
  DP, once per step: DistributedDataParallel all-reduces the gradients of the P parameters this rank holds,
      in the parameters' dtype (e P), in buckets filled in reverse parameter order and closed at
      >= bucket_size bytes (reference.data_parallel.buckets.bucket_layout), per chunk under interleaving.
      Megatron-LM with bf16 reduces fp32 main grads instead (4 P; --accumulate-allreduce-grads-in-fp32).
      With the distributed optimizer each bucket is padded to a multiple of d elements (P' in all) and
      reduce-scattered (e P'), and after the step the parameter buckets are all-gathered (e P'): the same
      count of each, twice the all-reduce's bytes by this convention, the same bytes on a ring's wire.

Bytes per rank (`memory`): parameters e P and gradients e P (e P' with the distributed optimizer); the
optimizer is Adam behind fp32 master weights (reference.data_parallel.mixed_precision; none when the model is
fp32): masters 4 P and moments 8 P on every DP rank, or 4 P'/d and 8 P'/d with the distributed optimizer: the
ZeRO paper's 2 + 2 + 12/N bytes per parameter at e = 2.
"""

from __future__ import annotations

import dataclasses

from reference.gpt.model import split_layers, split_virtual_stages
from reference.measure.scale.shapes import ScaleSetup

FP32 = 4


@dataclasses.dataclass(frozen=True)
class Term:
    """One source of traffic in a (group, op) row: how many collectives, how many bytes in all, and why."""

    count: int
    nbytes: int
    formula: str


def stage_layers(setup: ScaleSetup, stage: int) -> int:
    """Transformer layers on pipeline stage `stage`: num_layers / p, one more on the first num_layers mod p."""
    first, last = split_layers(setup.model.num_layers, setup.pp)[stage]
    return last - first


def chunk_layers(setup: ScaleSetup, stage: int, chunk: int) -> tuple[int, bool, bool]:
    """(layers, holds the embedding, holds the head) of model chunk `chunk` of stage `stage` (chunk 0 of 1
    without interleaving: the whole stage): the layers build_stage and build_chunks give it, the embedding
    with layer 0 and the head with the last layer."""
    num_layers, p, v = setup.model.num_layers, setup.pp, setup.virtual_stages
    if v == 1:
        first, last = split_layers(num_layers, p)[stage]
    else:
        first, last = split_virtual_stages(num_layers, p, v)[stage][chunk]
    return last - first, first == 0, last == num_layers


def stage_parameters(setup: ScaleSetup, stage: int, chunk: int = 0) -> list[int]:
    """Sizes of the parameters one TP rank of stage `stage` holds (in model chunk `chunk` under interleaving),
    in the model's order: word and position embeddings (first stage); per block ln1 (w, b), QKV (w, b),
    attention out (w, b), ln2 (w, b), fc1 (w, b), fc2 (w, b), column layers split on their output, row layers
    on their input; final LayerNorm (w, b) and output layer (last stage)."""
    m, t = setup.model, setup.tp
    h, f, vocab_rows = m.hidden_size, m.ffn_hidden_size, setup.padded_vocab_size // t
    layers, embeds, heads = chunk_layers(setup, stage, chunk)
    block = [h, h, 3 * h * h // t, 3 * h // t, h * h // t, h, h, h, f * h // t, f // t, h * f // t, h]
    sizes = [vocab_rows * h, m.seq_length * h] if embeds else []
    sizes += block * layers
    if heads:
        sizes += [h, h, vocab_rows * h]
    return sizes


def ddp_buckets(sizes: list[int], element_bytes: int, bucket_size: int | None) -> list[int]:
    """Bytes of each gradient bucket: parameters taken last to first, a bucket closed at >= bucket_size."""
    buckets, current = [], 0
    for size in reversed(sizes):
        current += size * element_bytes
        if bucket_size is not None and current >= bucket_size:
            buckets.append(current)
            current = 0
    return buckets + [current] if current else buckets


def padded_buckets(setup: ScaleSetup, stage: int) -> list[int]:
    """Elements of each gradient bucket, padded to a multiple of dp under the distributed optimizer
    (reference.data_parallel.buckets.padded_numel)."""
    e = setup.dtype_bytes
    elements = [
        nbytes // e
        for chunk in range(setup.virtual_stages)
        for nbytes in ddp_buckets(stage_parameters(setup, stage, chunk), e, setup.bucket_size)
    ]
    if not setup.distributed_optimizer:
        return elements
    return [-(-n // setup.dp) * setup.dp for n in elements]


def memory(setup: ScaleSetup, stage: int) -> dict[str, int]:
    """Bytes a rank of stage `stage` holds for parameters, gradients, fp32 masters and Adam's moments."""
    e, held = setup.dtype_bytes, sum(padded_buckets(setup, stage))
    share = held // setup.dp if setup.distributed_optimizer else held
    return {
        "parameters": e * held,
        "gradients": e * held,
        "master_weights": 0 if e == FP32 else FP32 * share,
        "optimizer_states": 2 * FP32 * share,
    }


def sequence_parallel_params(setup: ScaleSetup, stage: int, chunk: int = 0) -> int:
    """Replicated parameters that see only this rank's tokens under SP: LayerNorms and row-parallel biases."""
    h, (layers, _, heads) = setup.model.hidden_size, chunk_layers(setup, stage, chunk)
    return layers * 6 * h + (2 * h if heads else 0)


def human(nbytes: int) -> str:
    """Bytes for a table: 2 decimals of the largest binary unit (the CLI and the site's tables)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes} B"


def _exact(nbytes: int) -> str:
    """Bytes inside a formula's text: whole MiB when exact, else bytes."""
    return f"{nbytes / 2**20:g} MiB" if nbytes % 2**20 == 0 else f"{nbytes} B"


def expected(setup: ScaleSetup, stage: int) -> dict[tuple[str, str], list[Term]]:
    """{(group, op): [Term, ...]} for a rank at pipeline stage `stage`; groups "tp", "pp", "dp"."""
    model, mb, L, e = setup.model, setup.microbatches, stage_layers(setup, stage), setup.dtype_bytes
    first, last, sp = stage == 0, stage == setup.pp - 1, setup.sequence_parallel
    act = model.micro_batch_size * model.seq_length * model.hidden_size * e
    loss = model.micro_batch_size * model.seq_length * FP32
    rows: dict[tuple[str, str], list[Term]] = {}

    def add(group, op, count, nbytes, formula):
        """`count` collectives of `nbytes` bytes each."""
        rows.setdefault((group, op), []).append(Term(count, count * nbytes, formula))

    if setup.tp > 1 and not sp:
        add("tp", "all_reduce", 4 * mb * L, act, "4 m L x bshe (blocks: 2 fwd, 2 bwd)")
        if first:
            add("tp", "all_reduce", mb, act, "m x bshe (embedding)")
        if last:
            add("tp", "all_reduce", mb, act, "m x bshe (LM head input grad)")
            add("tp", "all_reduce", 3 * mb, loss, "3 m x 4bs (loss: max, target, sum-exp)")
    if sp:
        add("tp", "all_gather", 6 * mb * L, act, "6 m L x bshe (blocks: 2 fwd, 4 bwd)")
        add("tp", "reduce_scatter", 4 * mb * L, act, "4 m L x bshe (blocks: 2 fwd, 2 bwd)")
        if first:
            add("tp", "all_reduce", mb, act, "m x bshe (embedding)")
            add("tp", "all_gather", mb, act, "m x bshe (embedding's sequence split, bwd)")
        if last:
            add("tp", "all_gather", 2 * mb, act, "2 m x bshe (LM head input, fwd and bwd)")
            add("tp", "reduce_scatter", mb, act, "m x bshe (LM head input grad)")
            add("tp", "all_reduce", 3 * mb, loss, "3 m x 4bs (loss: max, target, sum-exp)")
        for chunk in range(setup.virtual_stages):  # one flat all-reduce per model chunk
            heads = chunk_layers(setup, stage, chunk)[2]
            per_chunk = "L" if setup.virtual_stages == 1 else "L/v"
            add(
                "tp",
                "all_reduce",
                1,
                sequence_parallel_params(setup, stage, chunk) * e,
                f"1 x (6h{per_chunk}" + (" + 2h" if heads else "") + ")e (SP LayerNorm + bias grads)",
            )
    if setup.pp > 1:
        add("pp", "barrier", 2, 0, "2 x 0 (bubble measurement: start, end)")
        shard = act // setup.tp if sp else act
        what = "bshe/t" if sp else "bshe"
        v = setup.virtual_stages
        for op, direction_first, direction_last in (
            ("send", "activations", "input grads"),
            ("recv", "output grads", "activations"),
        ):
            if v > 1:  # every chunk-forward but the model's last sends on, every one but its first receives
                add("pp", op, mb * (v - last), shard, f"m {'(v - 1)' if last else 'v'} x {what} ({direction_first})")
                add("pp", op, mb * (v - first), shard, f"m {'(v - 1)' if first else 'v'} x {what} ({direction_last})")
                continue
            if not last:
                add("pp", op, mb, shard, f"m x {what} ({direction_first})")
            if not first:
                add("pp", op, mb, shard, f"m x {what} ({direction_last})")
    if setup.dp > 1:
        buckets = padded_buckets(setup, stage)
        limit = "one bucket" if setup.bucket_size is None else f"buckets of >= {_exact(setup.bucket_size)}"
        if setup.distributed_optimizer:
            rows[("dp", "reduce_scatter")] = [Term(len(buckets), e * sum(buckets), f"eP' in {limit} (grads)")]
            rows[("dp", "all_gather")] = [Term(len(buckets), e * sum(buckets), f"eP' in {limit} (params)")]
        else:
            rows[("dp", "all_reduce")] = [Term(len(buckets), e * sum(buckets), f"eP in {limit} (DDP grads)")]
    return rows


def totals(terms: list[Term]) -> tuple[int, int]:
    """(count, bytes) of a row."""
    return sum(t.count for t in terms), sum(t.nbytes for t in terms)
