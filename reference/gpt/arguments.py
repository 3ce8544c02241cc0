"""The TP x PP x DP demo's flags (reference/gpt/demo.py) and their checks: what can be refused before any process
starts is refused here, in one line, so that no rank hangs waiting for another."""

from __future__ import annotations

import os

from reference.arguments import refuse_large_memory
from reference.data_parallel.wrapper import DEFAULT_BUCKET_SIZE
from reference.gpt.model import STYLES, GPTConfig, split_layers
from reference.gpt.parallelize import check_tensor_parallel, check_virtual_pipeline
from reference.parallel_state import ParallelConfigError, parallel_sizes
from reference.parallelize import DP_SHARDING, FULLY_SHARDED
from reference.pipeline.schedules import ALL_SCHEDULES
from reference.pipeline.zero_bubble import check_zero_bubble
from reference.recompute import RECOMPUTE_MODES

FSDP = {"fsdp": "FSDP", "fsdp2": "FSDP2"}  # the fully sharded choices: the reference each runs
ZERO = {"optimizer": "the optimizer state", "gradients": "the gradients and the optimizer state"}  # ZeRO-1, 2


def add_arguments(group) -> None:
    """Add the 3D-parallel flags to the shared parser's argument group."""
    group.add_argument(
        "--model",
        choices=STYLES,
        default="gpt2",
        help="the block: gpt2 (LayerNorm, GELU, learned positions) or llama (the Llama/Qwen2 block: "
        "RMSNorm, SwiGLU, rotary positions, grouped-query attention)",
    )
    group.add_argument(
        "--num-kv-heads",
        type=int,
        default=None,
        help="llama: key/value heads (query groups), split over --tp; default: half the attention heads",
    )
    group.add_argument("--tp", type=int, default=1, help="tensor-parallel size: ranks splitting every layer")
    group.add_argument("--pp", type=int, default=1, help="pipeline-parallel size: stages of consecutive layers")
    group.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size: ranks splitting each sequence (head-tail: rank r holds chunks r and "
        "2 cp - 1 - r of 2 cp), attention by ring; tp x cp x pp x dp must equal the world size",
    )
    group.add_argument(
        "--dp",
        type=int,
        default=None,
        help="data-parallel size: model replicas; default: world / (tp x pp). tp x pp x dp must equal the world size",
    )
    group.add_argument(
        "--schedule",
        choices=ALL_SCHEDULES,
        default="1f1b",
        help="pipeline schedule: all forwards then all backwards (gpipe), or one-forward-one-"
        "backward after a warm-up (1f1b: at most pp micro-batches in flight), or a zero-bubble one, each "
        "backward split into input gradient I and weight gradient W: zb-h1 (1f1b's warm-up, W's deferred), "
        "zbv (two stages per rank in a V; layers divisible by 2 pp), dualpipev (the same V, forwards "
        "and backwards paired; also m >= 2 pp)",
    )
    group.add_argument(
        "--virtual-stages",
        type=int,
        default=1,
        metavar="V",
        help="model chunks per pipeline stage; V > 1 runs interleaved 1F1B, whose bubble is "
        "(pp - 1) / (V m + pp - 1); needs the layers divisible by pp x V and m by pp",
    )
    group.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        help="micro-batches m per step and replica; the bubble is (pp - 1) / (m + pp - 1); "
        "default: 4, or 1 with --dp-sharding fsdp or fsdp2",
    )
    group.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split LayerNorm/dropout/residual activations along the sequence over TP: each "
        "all-reduce becomes an all-gather + reduce-scatter, stages exchange [s/tp, b, h]",
    )
    group.add_argument("--vocab-size", type=int, default=128, help="vocabulary size (padded to a multiple of tp)")
    group.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout probability")
    group.add_argument(
        "--dp-sharding",
        choices=list(DP_SHARDING),
        default="replicate",
        help="replicate: every DP rank holds the stage and all-reduces gradients in buckets (DDP); "
        "optimizer: the distributed optimizer (ZeRO-1) shards the optimizer state over DP "
        "(reduce-scatter gradients, all-gather parameters; needs dp > 1); "
        "gradients: ZeRO-2, the same, and each rank keeps only its shard of the reduced gradients "
        "(parameters whole; with Adam and --dtype bf16, whose gradients stay fp32, 2 + (4 + 12) / dp bytes per "
        "parameter, where the ZeRO paper's bf16 gradients give 2 + (2 + 12) / dp); "
        "fsdp: reference FSDP over the DP group shards the TP-sharded stage (2D, all-gathers "
        "and reduce-scatters; needs --pp 1 and --micro-batches 1); fsdp2: the same with the reference FSDP2, "
        "each TP-local parameter sharded on dim 0 (as fully_shard over DTensor TP)",
    )
    group.add_argument(
        "--bucket-size",
        type=int,
        default=DEFAULT_BUCKET_SIZE,
        metavar="BYTES",
        help="data-parallel gradient bucket size: one all-reduce per bucket over the DP group",
    )
    group.add_argument(
        "--no-overlap-grad-reduce",
        action="store_true",
        help="issue the data-parallel bucket all-reduces after backward instead of as soon as "
        "each bucket's gradients are ready (during the last micro-batch's backward)",
    )
    group.add_argument(
        "--recompute",
        choices=RECOMPUTE_MODES,
        default="none",
        help="activation recomputation per block: keep everything for backward (none), keep only "
        "the attention core's input and recompute QK^T/softmax/dropout/xV (selective), or keep "
        "only each block's input and recompute the block (full); same gradients in all three",
    )
    group.add_argument(
        "--no-async-grad-allreduce",
        action="store_true",
        help="wait for the input-gradient all-reduce/reduce-scatter before computing the weight "
        "gradient, instead of overlapping the two",
    )


def check(args) -> GPTConfig:
    """Everything that can be checked before starting the processes: one-line errors, no hang."""
    fsdp = args.dp_sharding in FULLY_SHARDED
    if args.micro_batches is None:
        args.micro_batches = 1 if fsdp else 4
    if fsdp and (args.pp > 1 or args.micro_batches > 1):
        raise ParallelConfigError(
            f"--dp-sharding {args.dp_sharding} needs --pp 1 and --micro-batches 1 (got --pp {args.pp} "
            f"--micro-batches {args.micro_batches}): the reference {FSDP[args.dp_sharding]} has no no_sync, so it "
            "cannot accumulate gradients over micro-batches and reduce-scatter once; use --dp-sharding replicate "
            "for pipelining"
        )
    if args.dp_sharding in ZERO:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        _, _, dp = parallel_sizes(world, args.tp, args.pp, args.dp, args.cp)
        if dp * args.cp == 1:  # the shards are over dp x cp, as megatron's distributed optimizer's
            raise ParallelConfigError(
                f"--dp-sharding {args.dp_sharding} shards {ZERO[args.dp_sharding]} over the data-parallel group, "
                f"but dp is 1 "
                f"(world {world} / (tp {args.tp} x pp {args.pp})): nothing to shard; launch more ranks or use "
                "--dp-sharding replicate"
            )
    if args.cp != 1:
        check_context_parallel(args)
    if min(args.steps, args.batch_size, args.micro_batches, args.bucket_size) < 1:
        raise ParallelConfigError("--steps, --micro-batch-size, --micro-batches and --bucket-size must be >= 1")
    if args.num_kv_heads is not None and (args.model != "llama" or args.num_kv_heads < 1):
        raise ParallelConfigError(f"--num-kv-heads {args.num_kv_heads}: needs --model llama and a positive count")
    kv_heads = args.num_kv_heads or max(1, args.num_attention_heads // 2)
    config = GPTConfig.from_sizes(
        args,
        hidden_dropout=args.dropout,
        attention_dropout=args.dropout,
        style=args.model,
        num_kv_heads=kv_heads if args.model == "llama" else None,
    )
    split_layers(config.num_layers, args.pp)
    in_flight = args.micro_batches if args.schedule == "gpipe" else min(args.micro_batches, args.pp)
    estimate = memory_per_rank(config, args, split=args.tp * args.pp, shards=1, in_flight=in_flight)
    if why := refuse_large_memory("this model", estimate):
        raise ParallelConfigError(why)
    check_tensor_parallel(config, args.tp, args.sequence_parallel)
    check_zero_bubble(args.schedule, args.pp, args.micro_batches, config.num_layers)
    if args.virtual_stages != 1:
        if args.schedule != "1f1b" or fsdp:
            raise ParallelConfigError(
                f"--virtual-stages {args.virtual_stages} needs --schedule 1f1b and "
                "--dp-sharding replicate or optimizer (interleaved 1F1B over DDP-wrapped "
                "chunks)"
            )
        check_virtual_pipeline(config.num_layers, args.pp, args.virtual_stages, args.micro_batches)
    return config


def check_context_parallel(args) -> None:
    """--cp N: the sizes fill the world, the sequence splits into 2 cp chunks, and what CP does not compose with
    here is refused."""
    if args.cp < 1:
        raise ParallelConfigError(f"--cp {args.cp}: the context-parallel size must be >= 1")
    parallel_sizes(int(os.environ.get("WORLD_SIZE", "1")), args.tp, args.pp, args.dp, args.cp)
    if args.seq_length % (2 * args.cp):
        raise ParallelConfigError(
            f"--seq-length {args.seq_length} does not split into 2 x cp {args.cp} chunks (head-tail balancing); "
            f"use a multiple of {2 * args.cp}"
        )
    unsupported = {
        "--sequence-parallel": args.sequence_parallel,
        "--dropout > 0": args.dropout > 0,
        f"--dp-sharding {args.dp_sharding}": args.dp_sharding in FULLY_SHARDED,
    }
    for flag, given in unsupported.items():
        if given:
            raise ParallelConfigError(f"--cp {args.cp} does not compose with {flag} here; use --cp 1 for it")


def memory_per_rank(config: GPTConfig, args, split: int, shards: int, in_flight: int) -> dict[str, float]:
    """Bytes a rank is estimated to need, fp32, named by the flags that size them: its 1/`split` of the
    weights, sharded `shards` ways, with gradients (and Adam's two moments), and `in_flight` micro-batches'
    activations (the attention scores s^2 per head among them) and logits."""
    h, s, b, layers = config.hidden_size, config.seq_length, args.batch_size, config.num_layers
    states = 4 if getattr(args, "optimizer", "sgd") == "adam" else 2
    weights = (layers * (12 * h * h + 13 * h) + (config.vocab_size + s) * h) / split
    per_layer = s * b * (16 * h + 2 * config.num_attention_heads * s) / split
    return {
        "weights (--num-layers x --hidden-size^2, --vocab-size)": 4.0 * states * weights / shards,
        "activations (--num-layers x --seq-length x --micro-batch-size x (--hidden-size, --seq-length))": 4.0
        * in_flight
        * layers
        * per_layer,
        "logits (--seq-length x --micro-batch-size x --vocab-size)": 4.0 * 3 * in_flight * s * b * config.vocab_size,
    }
