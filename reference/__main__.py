"""`torchrun --nproc-per-node N -m reference [--fsdp] ...`: a few training steps, with the collectives printed.

One parser for both demos so `--help` shows every flag. The tensor-parallel demo lives in
`reference.tensor_parallel.demo`, the FSDP one in `reference.fsdp.demo`; each adds its own argument group
and runs from the parsed arguments.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from reference.fsdp import demo as fsdp_demo
from reference.tensor_parallel import demo as tp_demo


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrun --nproc-per-node N -m reference",
        description="Train a small transformer for a few steps with the reference tensor parallelism "
                    "(default) or FSDP (--fsdp), printing the loss, the collectives of each step and the "
                    "process-group layout. Uses CUDA/NCCL when a GPU is visible, else CPU/gloo.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    common = parser.add_argument_group("model and data (both demos)")
    common.add_argument("--fsdp", action="store_true", help="run the FSDP demo instead of tensor parallelism")
    common.add_argument("--steps", type=int, default=3, help="optimizer steps to run")
    common.add_argument("--batch-size", type=int, default=2, help="micro-batch size b")
    common.add_argument("--seq-length", type=int, default=16, help="sequence length s")
    common.add_argument("--hidden-size", type=int, default=64, help="hidden size h")
    common.add_argument("--num-attention-heads", type=int, default=4, help="attention heads")
    common.add_argument("--num-layers", type=int, default=2, help="transformer blocks")
    common.add_argument("--seed", type=int, default=1234, help="seed for weights and data (same on every rank)")
    common.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate")
    common.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto picks cuda+nccl when a GPU is visible, else cpu+gloo")
    common.add_argument("--json", action="store_true", help="print one JSON object per step instead of text")
    common.add_argument("--trace", type=Path, default=None, metavar="DIR",
                        help="write the last step's recorded collectives and compute spans to "
                             "DIR/{tp,fsdp}_trace.rank<r>.json")
    tp_demo.add_arguments(parser.add_argument_group("tensor parallelism (default demo)"))
    fsdp_demo.add_arguments(parser.add_argument_group("FSDP (--fsdp)"))
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    (fsdp_demo if args.fsdp else tp_demo).run(args)


if __name__ == "__main__":
    main()
