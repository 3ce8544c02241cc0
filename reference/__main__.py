"""`torchrun --nproc-per-node N -m reference [--tp T --pp P --dp D | --fsdp | --moe --ep E] ...`: a few training
steps.

One parser for the demos so `--help` shows every flag. The TP x PP x DP demo (the default; with --pp 1
--dp 1 the tensor-parallel demo) lives in `reference.gpt.demo`, the FSDP one in `reference.fsdp.demo`, the
mixture-of-experts one in `reference.moe.demo`; each adds its own argument group and runs from the parsed
arguments.
"""

from __future__ import annotations

import argparse

from reference.arguments import OneLineParser, add_device_argument, add_flag, learning_rate, output_dir, steps, width
from reference.distributed import DTYPES, OPTIMIZERS
from reference.fsdp import demo as fsdp_demo
from reference.gpt import demo as gpt_demo
from reference.moe import demo as moe_demo


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="torchrun --nproc-per-node N -m reference",
        description="Train a small GPT for a few steps with the reference TP x PP x DP parallelism (default; "
        "e.g. --nproc-per-node 8 ... --tp 2 --pp 2 --dp 2) or FSDP (--fsdp), printing the layout, "
        "the loss and the collectives of each step per process group, and the pipeline schedule's "
        "bubble and peak in-flight micro-batches. Uses CUDA/NCCL when a GPU is visible, else "
        "CPU/gloo.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    common = parser.add_argument_group("model and data (both demos)")
    common.add_argument("--fsdp", action="store_true", help="run the FSDP demo instead of TP x PP x DP")
    common.add_argument(
        "--moe", action="store_true", help="run the mixture-of-experts demo (one MoE layer, --ep x --tp) instead"
    )
    common.add_argument("--steps", type=steps, default=3, help="optimizer steps to run")
    add_flag(
        common,
        "--micro-batch-size",
        "--batch-size",
        dest="batch_size",
        type=int,
        default=2,
        help="micro-batch size b, samples per rank per micro-batch: the global batch is b x micro-batches x dp "
        "(FSDP demo: b x the world size)",
    )
    common.add_argument("--seq-length", type=width, default=16, help="sequence length s")
    common.add_argument("--hidden-size", type=width, default=64, help="hidden size h")
    common.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    common.add_argument("--num-layers", type=int, default=2, help="transformer blocks")
    common.add_argument("--seed", type=int, default=1234, help="seed for weights and data (same on every rank)")
    common.add_argument("--lr", type=learning_rate, default=1e-2, help="learning rate (positive, finite)")
    common.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="sgd",
        help="sgd: plain SGD, no per-parameter state; adam: two fp32 moments per parameter (8 B each), the state "
        "the distributed optimizer and FSDP shard over DP (the memory report shows it)",
    )
    add_device_argument(common)
    common.add_argument(
        "--dtype",
        choices=["auto", *DTYPES],
        default="auto",
        help="auto: bf16 on CUDA, as Megatron trains, fp32 on CPU, where the tests compare exactly with the "
        "unsharded model. bf16 keeps fp32 where Megatron does: gradients reduced in fp32 main grads and an "
        "fp32 master copy stepped by the optimizer (default demo; with --dp-sharding fsdp, and in the FSDP "
        "demo, as --mixed-precision: bf16 compute over fp32 shards, fp32 reduce-scatter)",
    )
    common.add_argument("--json", action="store_true", help="print one JSON object per step instead of text")
    common.add_argument(
        "--trace",
        type=output_dir,
        default=None,
        metavar="DIR",
        help="write the last step's recorded collectives and compute spans to DIR/{gpt,fsdp}_trace.rank<r>.json",
    )
    gpt_demo.add_arguments(parser.add_argument_group("TP x PP x DP (default demo)"))
    fsdp_demo.add_arguments(parser.add_argument_group("FSDP (--fsdp)"))
    moe_demo.add_arguments(parser.add_argument_group("mixture of experts (--moe; also takes --tp and --dp)"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    (moe_demo if args.moe else fsdp_demo if args.fsdp else gpt_demo).run(args)


if __name__ == "__main__":
    main()
