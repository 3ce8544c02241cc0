"""Closed-form bytes and counts of one training step's collectives, per process group and collective type, and
the bytes a rank holds (`memory`), for the rank at pipeline stage `stage` of a ScaleSetup.

What reference.measure.scale.simulate records must equal these, row by row. The step is
reference.gpt.train.train_step; bytes follow the recorder's convention (an all-gather counts its output, a
reduce-scatter its input). Per micro-batch, TP moves one activation A = b s h e per region, PP one A (A / t under
sequence parallelism) across each stage boundary, and DP the gradients once per step, in buckets (FSDP2:
each group's parameters gathered and its gradients reduce-scattered, `fsdp2_rows`). The Scale
note derives every term, and names the upstream code each follows, such as
`megatron-lm:megatron/core/distributed/finalize_model_grads.py::_allreduce_non_tensor_model_parallel_grads`.
"""

from __future__ import annotations

import dataclasses

from reference.gpt.model import split_layers, split_virtual_stages
from reference.measure.scale.shapes import CPSetup, ModelShape, ScaleSetup
from reference.pipeline.schedules import bubble_formula, peak_in_flight_formula
from reference.pipeline.zero_bubble import V_SCHEDULES, v_layers

FP32 = 4


@dataclasses.dataclass(frozen=True)
class Term:
    """One source of traffic in a (group, op) row: how many collectives, how many bytes in all, and why."""

    count: int
    nbytes: int
    formula: str


def stage_layers(setup: ScaleSetup, stage: int) -> int:
    """Transformer layers on pipeline stage `stage`: num_layers / p, one more on the first num_layers mod p (in a
    V, its two stages' 2 num_layers / 2p)."""
    return sum(chunk_layers(setup, stage, chunk)[0] for chunk in range(setup.chunks))


def chunk_layers(setup: ScaleSetup, stage: int, chunk: int) -> tuple[int, bool, bool]:
    """(layers, holds the embedding, holds the head) of model chunk `chunk` of stage `stage` (chunk 0 of 1
    without interleaving: the whole stage; in a V, chunk 1 is the stage on the way back): the layers build_stage
    and build_chunks give it, the embedding with layer 0 and the head with the last layer."""
    num_layers, p, v = setup.model.num_layers, setup.pp, setup.virtual_stages
    if setup.schedule in V_SCHEDULES:
        first, last = v_layers(num_layers, p, stage)[chunk]
    elif v == 1:
        first, last = split_layers(num_layers, p)[stage]
    else:
        first, last = split_virtual_stages(num_layers, p, v)[stage][chunk]
    return last - first, first == 0, last == num_layers


def block_parameters(setup: ScaleSetup) -> list[tuple[int, int]]:
    """(rows, elements per row) of each parameter of one block on one TP rank, in the model's order, column
    layers split on their output, row layers on their input. GPT-2: ln1 (w, b), QKV (w, b), attention out
    (w, b), ln2 (w, b), fc1 (w, b), fc2 (w, b). Llama: ln1, the grouped QKV (a + 2k heads of d; its bias where
    the shape has one), o-proj, ln2, [gate; up] (2f rows), down: RMSNorm weights and no other bias."""
    m, t = setup.model, setup.tp
    h, f = m.hidden_size, m.ffn_hidden_size
    if not m.llama:
        block = [(h, 1), (h, 1), (3 * h // t, h), (3 * h // t, 1), (h, h // t), (h, 1)]
        return block + [(h, 1), (h, 1), (f // t, h), (f // t, 1), (h, f // t), (h, 1)]
    qkv_rows = (m.num_attention_heads + 2 * m.kv_heads) * (h // m.num_attention_heads) // t
    qkv = [(qkv_rows, h)] + ([(qkv_rows, 1)] if m.qkv_bias else [])
    return [(h, 1), *qkv, (h, h // t), (h, 1), (2 * f // t, h), (h, f // t)]


def end_parameters(setup: ScaleSetup) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(embedding, head) parameters of one TP rank as (rows, elements per row): the word embedding's rows of
    the padded vocabulary and, for GPT-2, the learned positions; the final norm's weight (and LayerNorm's
    bias) and the output layer's rows."""
    m = setup.model
    h, vocab_rows = m.hidden_size, setup.padded_vocab_size // setup.tp
    if m.llama:
        return [(vocab_rows, h)], [(h, 1), (vocab_rows, h)]
    return [(vocab_rows, h), (m.seq_length, h)], [(h, 1), (h, 1), (vocab_rows, h)]


def stage_parameters(setup: ScaleSetup, stage: int, chunk: int = 0) -> list[int]:
    """Sizes of the parameters one TP rank of stage `stage` holds (in model chunk `chunk` under interleaving),
    in the model's order: the embedding (first stage), block_parameters per block, the final norm and output
    layer (last stage)."""
    layers, embeds, heads = chunk_layers(setup, stage, chunk)
    embedding, head = end_parameters(setup)
    block = [rows * row for rows, row in block_parameters(setup)]
    return [r * n for r, n in embedding] * embeds + block * layers + [r * n for r, n in head] * heads


def parameter_count(model: ModelShape) -> int:
    """Parameters of the whole model, unsplit and unpadded (tp 1, pp 1): for the llama3 presets the count of
    Hugging Face's LlamaForCausalLM at the same LlamaConfig (tests/reference/test_scale.py builds it)."""
    return sum(stage_parameters(ScaleSetup(model, tp=1, pp=1, dp=1, microbatches=1), 0))


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
        for chunk in range(setup.chunks)
        for nbytes in ddp_buckets(stage_parameters(setup, stage, chunk), e, setup.bucket_size)
    ]
    if not setup.distributed_optimizer:
        return elements
    return [-(-n // setup.dp) * setup.dp for n in elements]


def fsdp2_groups(setup: ScaleSetup) -> list[list[tuple[int, int]]]:
    """(rows, elements per row) of each TP-local parameter, per `fully_shard` group of the one stage (pp 1):
    the root (the embedding, the final norm, the output layer), then each block (block_parameters)."""
    embedding, head = end_parameters(setup)
    return [embedding + head] + [block_parameters(setup)] * setup.model.num_layers


def fsdp2_numel(group: list[tuple[int, int]], shards: int, shard_rank: int | None = None) -> int:
    """Elements of a group's all-gather output (every parameter's rows padded to a multiple of `shards`), or
    with `shard_rank` that rank's unpadded rows: torch.chunk's chunks of ceil(rows / shards) rows."""
    total = 0
    for rows, row in group:
        chunk = -(-rows // shards)
        total += row * (chunk * shards if shard_rank is None else min(max(rows - shard_rank * chunk, 0), chunk))
    return total


def memory(setup: ScaleSetup, stage: int, shard_rank: int = 0) -> dict[str, int]:
    """Bytes a rank of stage `stage` holds for parameters, gradients, fp32 masters and Adam's moments (FSDP2:
    at `shard_rank` of its shard group; the padded fp32 shards are the masters, Adam's moments cover the unpadded
    rows)."""
    if setup.fsdp2:
        groups, d = fsdp2_groups(setup), setup.shard_size
        padded = sum(fsdp2_numel(g, d) for g in groups) // d
        return {
            "parameters": FP32 * padded,
            "gradients": FP32 * padded,
            "master_weights": 0,
            "optimizer_states": 2 * FP32 * sum(fsdp2_numel(g, d, shard_rank) for g in groups),
        }
    e, held = setup.dtype_bytes, sum(padded_buckets(setup, stage))
    share = held // setup.dp if setup.distributed_optimizer else held
    return {
        "parameters": e * held,
        "gradients": e * (share if setup.shard_gradients else held),  # ZeRO-2 keeps its shard only
        "master_weights": 0 if e == FP32 else FP32 * share,
        "optimizer_states": 2 * FP32 * share,
    }


def pipeline(setup: ScaleSetup, stage: int) -> dict[str, int]:
    """The most forwards (chunk-forwards with several chunks) stage `stage` holds for their backward, as its
    schedule's order implies (reference.pipeline.schedules.peak_in_flight_formula): the traced rank's autograd
    must hold as many at its peak. pp > 1."""
    return {
        "peak_in_flight": peak_in_flight_formula(
            setup.schedule, setup.pp, stage, setup.microbatches, setup.virtual_stages
        )
    }


def bubble(setup: ScaleSetup) -> float:
    """The schedule's idle fraction with uniform stages (reference.pipeline.schedules.bubble_formula; zero
    bubble with F = I = W)."""
    return bubble_formula(setup.pp, setup.microbatches, setup.virtual_stages, setup.schedule)


def sequence_parallel_params(setup: ScaleSetup, stage: int, chunk: int = 0) -> int:
    """Replicated parameters that see only this rank's tokens under SP: the norms and row-parallel biases
    (GPT-2: 6h a layer; Llama: its two RMSNorm weights, 2h), and the final norm's on the last stage."""
    layers, _, heads = chunk_layers(setup, stage, chunk)
    per_layer, final = sp_norm_widths(setup.model)
    return (layers * per_layer + (final if heads else 0)) * setup.model.hidden_size


def sp_norm_widths(model: ModelShape) -> tuple[int, int]:
    """(per layer, final) multiples of h of the SP-replicated parameters: GPT-2 (6, 2), Llama (2, 1)."""
    return (2, 1) if model.llama else (6, 2)


def human(nbytes: int) -> str:
    """Bytes for a table: 2 decimals of the largest binary unit (the CLI and the site's tables)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:,.2f} {unit}"
    return f"{nbytes} B"


def _exact(nbytes: int) -> str:
    """Bytes inside a formula's text: whole MiB when exact, else bytes."""
    return f"{nbytes / 2**20:g} MiB" if nbytes % 2**20 == 0 else f"{nbytes} B"


def expected(setup: ScaleSetup, stage: int, shard_rank: int = 0) -> dict[tuple[str, str], list[Term]]:
    """{(group, op): [Term, ...]} for a rank at pipeline stage `stage` (FSDP2: at `shard_rank`); groups "tp",
    "pp", "dp", and under HSDP "dp_shard" and "dp_replicate" instead of "dp"."""
    model, mb, L, e = setup.model, setup.microbatches, stage_layers(setup, stage), setup.dtype_bytes
    first, last, sp = stage == 0, stage == setup.pp - 1, setup.sequence_parallel
    holds = [chunk_layers(setup, stage, chunk) for chunk in range(setup.chunks)]
    embeds, heads = any(h[1] for h in holds), any(h[2] for h in holds)  # in a V, rank 0 holds both
    act = model.micro_batch_size * model.seq_length * model.hidden_size * e
    loss = model.micro_batch_size * model.seq_length * FP32
    rows: dict[tuple[str, str], list[Term]] = {}

    def add(group, op, count, nbytes, formula):
        """`count` collectives of `nbytes` bytes each."""
        rows.setdefault((group, op), []).append(Term(count, count * nbytes, formula))

    if setup.tp > 1 and not sp:
        add("tp", "all_reduce", 4 * mb * L, act, "4 m L x bshe (blocks: 2 fwd, 2 bwd)")
        if embeds:
            add("tp", "all_reduce", mb, act, "m x bshe (embedding)")
        if heads:
            add("tp", "all_reduce", mb, act, "m x bshe (LM head input grad)")
            add("tp", "all_reduce", 3 * mb, loss, "3 m x 4bs (loss: max, target, sum-exp)")
    if sp:
        add("tp", "all_gather", 6 * mb * L, act, "6 m L x bshe (blocks: 2 fwd, 4 bwd)")
        add("tp", "reduce_scatter", 4 * mb * L, act, "4 m L x bshe (blocks: 2 fwd, 2 bwd)")
        if embeds:
            add("tp", "all_reduce", mb, act, "m x bshe (embedding)")
            add("tp", "all_gather", mb, act, "m x bshe (embedding's sequence split, bwd)")
        if heads:
            add("tp", "all_gather", 2 * mb, act, "2 m x bshe (LM head input, fwd and bwd)")
            add("tp", "reduce_scatter", mb, act, "m x bshe (LM head input grad)")
            add("tp", "all_reduce", 3 * mb, loss, "3 m x 4bs (loss: max, target, sum-exp)")
        if setup.fsdp2:  # on the fp32 gradient shards, after the reduce-scatter: each [h] cut over the shards
            chunk = -(-model.hidden_size // setup.shard_size)
            local = min(max(model.hidden_size - shard_rank * chunk, 0), chunk)
            per_layer, final = sp_norm_widths(model)
            what = f"1 x ({per_layer}L + {final}) x 4h/{setup.shard_size} (SP {_norms(model)} grad shards, fp32)"
            add("tp", "all_reduce", 1, (per_layer * L + final) * local * FP32, what)
        for chunk in range(setup.chunks if not setup.fsdp2 else 0):  # one flat all-reduce per model chunk
            head = holds[chunk][2]
            per_chunk = "L" if setup.chunks == 1 else "L/v" if setup.virtual_stages > 1 else "L/2"
            per_layer, final = sp_norm_widths(model)
            add(
                "tp",
                "all_reduce",
                1,
                sequence_parallel_params(setup, stage, chunk) * e,
                f"1 x ({per_layer}h{per_chunk}" + (f" + {final}h" if head else "") + f")e (SP {_norms(model)} grads)",
            )
    if setup.pp > 1:
        add("pp", "barrier", 2, 0, "2 x 0 (bubble measurement: start, end)")
        shard = act // setup.tp if sp else act
        what = "bshe/t" if sp else "bshe"
        v = setup.virtual_stages
        if setup.schedule in V_SCHEDULES:
            v_rows(mb, first + last, shard, what, add)
        for op, direction_first, direction_last in (
            ("send", "activations", "input grads"),
            ("recv", "output grads", "activations"),
        ):
            if setup.schedule in V_SCHEDULES:
                continue
            if v > 1:  # every chunk-forward but the model's last sends on, every one but its first receives
                add("pp", op, mb * (v - last), shard, f"m {'(v - 1)' if last else 'v'} x {what} ({direction_first})")
                add("pp", op, mb * (v - first), shard, f"m {'(v - 1)' if first else 'v'} x {what} ({direction_last})")
                continue
            if not last:
                add("pp", op, mb, shard, f"m x {what} ({direction_first})")
            if not first:
                add("pp", op, mb, shard, f"m x {what} ({direction_last})")
    if setup.fsdp2:
        fsdp2_rows(setup, add)
    elif setup.dp > 1:
        buckets = padded_buckets(setup, stage)
        limit = "one bucket" if setup.bucket_size is None else f"buckets of >= {_exact(setup.bucket_size)}"
        if setup.distributed_optimizer:
            rows[("dp", "reduce_scatter")] = [Term(len(buckets), e * sum(buckets), f"eP' in {limit} (grads)")]
            rows[("dp", "all_gather")] = [Term(len(buckets), e * sum(buckets), f"eP' in {limit} (params)")]
        else:
            rows[("dp", "all_reduce")] = [Term(len(buckets), e * sum(buckets), f"eP in {limit} (DDP grads)")]
    return rows


def v_rows(mb: int, ends: int, shard: int, what: str, add) -> None:
    """The point-to-point traffic of a rank in a V (zbv, dualpipev): each of its two stages sends its activations
    on and its input gradients back, and receives as much, but across the V's two ends (the first and the last
    stage are both on rank 0; the turn, stages p - 1 and p, on rank p - 1) nothing is sent. An inner rank has
    two neighbours, an end rank (rank 0 or p - 1: `ends` 1) one, so 2m or m messages each way and kind."""
    count, times = mb * (2 - ends), "m" if ends else "2m"
    for op, first, second in (("send", "activations", "input grads"), ("recv", "activations", "output grads")):
        add("pp", op, count, shard, f"{times} x {what} ({first})")
        add("pp", op, count, shard, f"{times} x {what} ({second})")


def fsdp2_rows(setup: ScaleSetup, add) -> None:
    """FSDP2's traffic (reference.fsdp2): per group one all-gather of its padded parameters (in the model's
    dtype) before forward and, but for the root (kept), again before backward, one fp32 reduce-scatter after
    it; under HSDP an fp32 all-reduce of each reduce-scatter's output over the replicas."""
    d, e, L = setup.shard_size, setup.dtype_bytes, setup.model.num_layers
    root, block = (fsdp2_numel(g, d) for g in fsdp2_groups(setup)[:2])
    group = "dp" if setup.dp_replicate == 1 else "dp_shard"
    add(group, "all_gather", 1, e * root, f"1 x e R (root: fwd, kept for bwd; R padded to {d} per parameter)")
    add(group, "all_gather", 2 * L, e * block, "2 L x e B (blocks: fwd and bwd)")
    add(group, "reduce_scatter", 1, FP32 * root, "1 x 4R (root grads)")
    add(group, "reduce_scatter", L, FP32 * block, "L x 4B (block grads)")
    if setup.dp_replicate > 1:
        add("dp_replicate", "all_reduce", 1, FP32 * root // d, f"1 x 4R/{d} (root grad shards)")
        add("dp_replicate", "all_reduce", L, FP32 * block // d, f"L x 4B/{d} (block grad shards)")


def _norms(model: ModelShape) -> str:
    """What the SP-replicated parameters are, as the formulas name them."""
    return "RMSNorm" if model.llama else "LayerNorm + bias"


def totals(terms: list[Term]) -> tuple[int, int]:
    """(count, bytes) of a row."""
    return sum(t.count for t in terms), sum(t.nbytes for t in terms)


def cp_rows(setup: CPSetup) -> dict[str, Term]:
    """Closed forms of one layer's ring attention on one cp rank, forward + backward
    (reference.context_parallel.ring_attention), with n = b (heads / t) (s / cp) d elements of q, k or v
    and e bytes each:
      forward, per ring step: K and V, 2 n e, sent cp - 1 times (the last step sends nothing);
      backward, per ring step: K, V and the fp32 dK, dV accumulated so far in one fp32 message, 4 n x 4,
      cp - 1 times, plus one last hop of dK, dV home, 2 n x 4 (sends; the rank receives as much);
      saved for backward: q, k, v (3 n e), the fp32 output (4 n) and log-sum-exp (4 n / d)."""
    b, heads, s, d = setup.shard_shape
    n, e, cp = b * heads * s * d, setup.params_dtype.itemsize, setup.cp
    step = 2 * n * e
    backward = (cp - 1) * 4 * n * FP32 + 2 * n * FP32 if cp > 1 else 0
    return {
        "K/V per ring step": Term(1, step, f"2 n e = 2 x {n:,} x {e}"),
        "forward sends": Term(cp - 1, (cp - 1) * step, f"(cp - 1) x 2 n e, cp = {cp}"),
        "backward sends": Term(cp if cp > 1 else 0, backward, "(cp - 1) x 4 n x 4 + 2 n x 4 (K, V, dK, dV in fp32)"),
        "saved activations": Term(5, 3 * n * e + n * FP32 + b * heads * s * FP32, "3 n e + 4 n + 4 n / d"),
    }
