"""`torchrun --nproc-per-node CP -m reference.measure.cp_blocks [--seq-length S] [--json]`: which attention blocks
each rank's ring attention computes at each ring step, without and with head-tail load balancing.

Runs reference.context_parallel.ring_attention forward on the cp = world ranks (gloo), once unbalanced and once
balanced, with an observer (the ring's `observer` argument) that reads what each step holds. Every token's q, k
and v carry its position as a value ([position, 1], fp64), so the observer reads the chunks from the data that
travelled round the ring, not from the plan that sent it: for each (query chunk, key chunk) pair, whether the
step computed it full, masked (causal on the diagonal) or skipped it, and the query-key pairs it attended
(key position <= query position). Each rank's output is checked against causal attention of the whole sequence
before anything is printed. The walkthrough's figure (study.cp_figure) is drawn from the --json output,
recorded by tools/record-traces into reading_notes/traces/cp_blocks.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reference.arguments import OneLineParser
from reference.context_parallel import held_chunks, ring_attention, shard
from reference.context_parallel.load_balance import chunk_count
from reference.parallel_state import ParallelConfigError


class BlockObserver:
    """The ring's observer: per forward step, the key chunks this rank held and every (query, key) block."""

    def __init__(self, chunk_length: int):
        self.chunk_length, self.steps = chunk_length, []

    def chunk_of(self, block: torch.Tensor) -> tuple[int, list[int]]:
        """The chunk a [1, 1, c, 2] slice holds, read from its position values, and those positions."""
        at = block[0, 0, :, 0].round().long().tolist()
        if at != list(range(at[0], at[0] + self.chunk_length)) or at[0] % self.chunk_length:
            raise AssertionError(f"a ring step held positions {at}, not one whole chunk")
        return at[0] // self.chunk_length, at

    def __call__(self, step: int, query_chunks, key_chunks, computed) -> None:
        kinds = {(qi, ki): "masked" if masked else "full" for qi, ki, masked in computed}
        blocks = []
        for qi, q in enumerate(query_chunks):
            (q_chunk, q_at) = self.chunk_of(q)
            for ki, k in enumerate(key_chunks):
                (k_chunk, k_at) = self.chunk_of(k)
                kind = kinds.get((qi, ki), "skipped")
                pairs = sum(kp <= qp for qp in q_at for kp in k_at)
                if (kind == "skipped") != (pairs == 0):
                    raise AssertionError(f"step {step}: block q{q_chunk} k{k_chunk} {kind} but {pairs} pairs needed")
                blocks.append({"query_chunk": q_chunk, "key_chunk": k_chunk, "kind": kind, "pairs": pairs})
        held = sorted({b["key_chunk"] for b in blocks})
        self.steps.append(
            {"step": step, "key_chunks": held, "blocks": blocks, "pairs": sum(b["pairs"] for b in blocks)}
        )


def tagged(seq_length: int) -> torch.Tensor:
    """q = k = v of a whole sequence, [1, 1, s, 2]: each token's [position, 1]."""
    at = torch.arange(seq_length, dtype=torch.float64)
    return torch.stack([at, torch.ones_like(at)], dim=-1)[None, None]


def record_run(seq_length: int, balanced: bool) -> dict:
    """This rank's blocks over one forward of the ring, then every rank's, gathered (the same on every rank)."""
    rank, cp = dist.get_rank(), dist.get_world_size()
    n = chunk_count(cp, balanced)
    whole = tagged(seq_length)
    local = shard(whole, 2, rank, cp, balanced)
    observer = BlockObserver(seq_length // n)
    out = ring_attention(local, local, local, dist.group.WORLD, balanced, observer=observer)
    expected = shard(F.scaled_dot_product_attention(whole, whole, whole, is_causal=True), 2, rank, cp, balanced)
    if not torch.allclose(out, expected, rtol=1e-12, atol=1e-12):
        raise AssertionError(f"rank {rank}: ring attention differs from causal attention of the whole sequence")
    mine = {
        "rank": rank,
        "chunks": list(held_chunks(rank, cp, balanced)),
        "steps": observer.steps,
        "pairs": sum(st["pairs"] for st in observer.steps),
    }
    ranks: list[dict | None] = [None] * cp
    dist.all_gather_object(ranks, mine)
    return {"balanced": balanced, "chunks": n, "chunk_length": seq_length // n, "ranks": ranks}


def document(seq_length: int) -> dict:
    cp = dist.get_world_size()
    return {
        "kind": "cp_blocks",
        "cp": cp,
        "seq_length": seq_length,
        "pairs_total": seq_length * (seq_length + 1) // 2,
        "runs": [record_run(seq_length, balanced) for balanced in (False, True)],
    }


def _step_text(step: dict) -> str:
    return ", ".join(f"q{b['query_chunk']}k{b['key_chunk']} {b['kind']}" for b in step["blocks"])


def format_document(doc: dict) -> str:
    cp, s = doc["cp"], doc["seq_length"]
    lines = [f"ring attention, cp {cp}, {s} causal tokens: each rank's blocks (query chunk, key chunk) per ring step"]
    for run in doc["runs"]:
        n, c = run["chunks"], run["chunk_length"]
        how = (
            f"head-tail balanced: {n} chunks of {c} tokens, rank r holds chunks r and {n - 1} - r"
            if run["balanced"]
            else f"not balanced: {n} chunks of {c} tokens, rank r holds chunk r"
        )
        lines.append(how)
        for r in run["ranks"]:
            lines.append(f"  rank {r['rank']} (chunks {', '.join(map(str, r['chunks']))}):")
            lines += [f"    step {st['step']}: {_step_text(st)}" for st in r["steps"]]
        pairs = [r["pairs"] for r in run["ranks"]]
        lines.append(
            f"  query-key pairs attended per rank: {', '.join(map(str, pairs))} (of {doc['pairs_total']}; "
            f"the busiest rank {max(pairs) / min(pairs):.2f}x the idlest)"
        )
    return "\n".join(lines)


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m reference.measure.cp_blocks", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-length", type=int, default=16, help="tokens in the sequence (2 x cp must divide it)")
    parser.add_argument("--json", action="store_true", help="print the recording as one JSON line")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    dist.init_process_group("gloo")
    first = dist.get_rank() == 0
    try:
        cp = dist.get_world_size()
        if args.seq_length < 1 or args.seq_length % (2 * cp):
            raise ParallelConfigError(f"--seq-length {args.seq_length} is not divisible by 2 x cp ({2 * cp})")
        doc = document(args.seq_length)
    except ParallelConfigError as error:
        if first:
            print(f"reference.measure.cp_blocks: error: {error}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    if first:
        print(json.dumps(doc) if args.json else format_document(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
