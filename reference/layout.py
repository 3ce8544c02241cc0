"""`python -m reference.layout --tp 2 --pp 2 --dp 2 [--ep 2]`: print which ranks form each TP, PP and DP group
(and, with --ep, each expert-parallel and expert data-parallel group, as megatron-core places them).

No processes are started: the groups are computed with the same `Mesh` that `build_layout` cuts them from at
run time, so what this prints is what a `torchrun ... -m reference --tp 2 --pp 2 --dp 2` job creates.
"""

from __future__ import annotations

import argparse
import json
import sys

from reference.arguments import MAX_WORLD, OneLineParser, refuse_large_world, world_size
from reference.parallel_state import ORDERS, Mesh, ParallelConfigError, parallel_sizes


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m reference.layout",
        description="Print the process groups of a TP x PP x DP layout (TP groups are consecutive ranks). "
        "Give the three sizes, or --world and some of them (DP defaults to what is left). "
        f"At most {MAX_WORLD:,} ranks: the groups list every rank.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--tp", type=world_size, default=1, help="tensor-parallel size")
    parser.add_argument("--pp", type=world_size, default=1, help="pipeline-parallel size (stages)")
    parser.add_argument("--dp", type=world_size, default=None, help="data-parallel size; default: world / (tp x pp)")
    parser.add_argument(
        "--ep",
        type=world_size,
        default=1,
        help="expert-parallel size of the MoE layers: carved out of DP (it must divide dp), varying right after TP",
    )
    parser.add_argument(
        "--cp",
        type=world_size,
        default=1,
        help="context-parallel size (a placeholder dimension here: its groups vary right after TP, as megatron's)",
    )
    parser.add_argument(
        "--world",
        type=world_size,
        default=None,
        help="number of ranks; default: tp x pp x dp. Refused when the product differs",
    )
    parser.add_argument(
        "--order",
        choices=ORDERS,
        default="tp-pp-dp",
        help="dimensions from fastest- to slowest-varying rank (megatron's `order`)",
    )
    parser.add_argument("--rank", type=int, default=None, help="also say where this rank sits")
    parser.add_argument("--json", action="store_true", help="print the groups as one JSON object")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cp = {"cp": args.cp} if args.cp > 1 else {}
    refuse_large_world(parser, tp=args.tp, **cp, pp=args.pp, dp=args.dp or 1)
    try:
        if args.world is None and args.dp is None:
            raise ParallelConfigError("give --dp or --world")
        world = args.world if args.world is not None else args.tp * args.cp * args.pp * args.dp
        tp, pp, dp = parallel_sizes(world, args.tp, args.pp, args.dp, args.cp)
        if args.rank is not None and not 0 <= args.rank < world:
            raise ParallelConfigError(f"--rank {args.rank} is outside the world of {world} ranks")
        mesh = Mesh(tp, pp, dp, cp=args.cp, ep=args.ep, order=args.order)
    except ParallelConfigError as error:
        print(f"reference.layout: error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "world": world,
                    "tp": tp,
                    "pp": pp,
                    "dp": dp,
                    "order": args.order,
                    **({"cp": mesh.cp, "cp_groups": mesh.ranks("cp")} if mesh.cp > 1 else {}),
                    **{f"{kind}_groups": mesh.ranks(kind) for kind in ("tp", "pp", "dp")},
                    "ep": args.ep,
                    **{  # at ep 1 every rank holds all experts: groups of one
                        f"{kind}_groups": mesh.ranks(kind) if mesh.ep > 1 else [[r] for r in range(world)]
                        for kind in ("ep", "edp")
                    },
                }
            )
        )
    else:
        print(mesh.describe(args.rank))
    return 0


if __name__ == "__main__":
    sys.exit(main())
