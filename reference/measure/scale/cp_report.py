"""`python -m reference.measure.scale --model 405b --tp 8 --cp 16 --pp 16 --dp 1`: the CP branch of the CLI.

Runs one layer's causal ring attention (reference.context_parallel.ring_attention), forward and backward, as
one rank of the cp group sees it: on the meta device (no memory, no compute) over the fake process group, at
the rank's real shard shape [b, heads / tp, s / cp, d]. Records the K/V bytes each ring step sends, the sends
of forward and of backward, and the bytes autograd saves for backward, and prints each beside its closed form
(reference.measure.scale.formulas.cp_rows), then the rank's totals over its pipeline stage's layers. Exit 0
when every row agrees, 1 when one does not, 2 for a setup that cannot exist.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from reference.context_parallel import ring_attention
from reference.gpt.model import split_layers
from reference.measure.recorder import CollectiveRecorder
from reference.measure.scale import formulas
from reference.measure.scale.shapes import CPSetup, cp_setup_for
from reference.parallel_state import ParallelConfigError

NOT_MODELLED = {  # flags of the dense trace the CP rows leave alone, refused away from their defaults
    "sequence_parallel": (False, "--sequence-parallel"),
    "dp_sharding": ("replicate", "--dp-sharding other than replicate"),
    "virtual_stages": (1, "--virtual-stages"),
    "dp_replicate": (1, "--dp-replicate"),
    "ep": (1, "--ep"),
}


def setup_from(args: argparse.Namespace) -> CPSetup:
    """The CP setup these parsed arguments describe; ParallelConfigError for one that cannot exist or a flag
    the CP rows do not model."""
    for name, (default, flag) in NOT_MODELLED.items():
        if getattr(args, name) != default:
            raise ParallelConfigError(f"{flag} is not modelled with --cp (the CP rows trace the attention alone)")
    return cp_setup_for(args.model.lower(), tp=args.tp, cp=args.cp, pp=args.pp, dp=args.dp)


def trace(setup: CPSetup, rank: int = 0, device: str = "meta") -> dict[str, formulas.Term]:
    """The measured rows, named as formulas.cp_rows names them: cp rank `rank`'s ring attention of one layer.
    device "cpu" runs it on real tensors (small shapes only), to show that the meta device changes nothing."""
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=setup.cp)
    try:
        qkv = [torch.randn(setup.shard_shape, device=device).to(setup.params_dtype) for _ in range(3)]
        leaves = [t.requires_grad_() for t in qkv]
        saved: list[int] = []
        with CollectiveRecorder() as forward:
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.nbytes) or t, lambda t: t):
                out = ring_attention(*leaves, dist.group.WORLD, balanced=setup.balanced)
        with CollectiveRecorder() as backward:
            out.backward(torch.ones_like(out))
    finally:
        dist.destroy_process_group()
    sends = {name: [e.nbytes for e in rec.events if e.op == "send"] for name, rec in (("f", forward), ("b", backward))}
    return {
        "K/V per ring step": formulas.Term(min(1, len(sends["f"])), sends["f"][0] if sends["f"] else 0, ""),
        "forward sends": formulas.Term(len(sends["f"]), sum(sends["f"]), ""),
        "backward sends": formulas.Term(len(sends["b"]), sum(sends["b"]), ""),
        "saved activations": formulas.Term(len(saved), sum(saved), ""),
    }


def document(setup: CPSetup) -> dict:
    measured, expected = trace(setup), formulas.cp_rows(setup)
    rows = [
        {
            "what": what,
            "count": measured[what].count,
            "bytes": measured[what].nbytes,
            "formula_count": term.count,
            "formula_bytes": term.nbytes,
            "formula": term.formula,
        }
        for what, term in expected.items()
    ]
    first, last = split_layers(setup.model.num_layers, setup.pp)[0]
    layers = last - first
    per_layer = measured["forward sends"].nbytes + measured["backward sends"].nbytes
    return {
        "setup": {"model": setup.model.name, "tp": setup.tp, "cp": setup.cp, "pp": setup.pp, "dp": setup.dp},
        "world": setup.world,
        "shard_shape": list(setup.shard_shape),
        "rows": rows,
        "stage_layers": layers,
        "ring_bytes_per_layer": per_layer,
        "ring_bytes_per_stage": layers * per_layer,
        "saved_bytes_per_stage": layers * measured["saved activations"].nbytes,
        "agree": all(r["count"] == r["formula_count"] and r["bytes"] == r["formula_bytes"] for r in rows),
    }


def format_document(doc: dict) -> str:
    s = doc["setup"]
    b, heads, seq, d = doc["shard_shape"]
    lines = [
        f"{s['model']} ring attention on tp {s['tp']} x cp {s['cp']} x pp {s['pp']} x dp {s['dp']} = "
        f"{doc['world']} ranks, causal, head-tail balanced; a cp rank's shard: b {b} x {heads} heads x "
        f"{seq} tokens x d {d} (n = {b * heads * seq * d:,} elements)",
        "one layer, forward + backward, on one cp rank:",
        f"  {'row':18} {'count':>6} {'bytes':>16} {'':>12}  formula",
    ]
    for r in doc["rows"]:
        ok = r["count"] == r["formula_count"] and r["bytes"] == r["formula_bytes"]
        verdict = "" if ok else f"   MISMATCH: formula gives {r['formula_count']} x, {r['formula_bytes']} B"
        lines.append(
            f"  {r['what']:18} {r['count']:>6} {r['bytes']:>16,} {formulas.human(r['bytes']):>12}  "
            f"{r['formula']}{verdict}"
        )
    lines.append(
        f"per rank over its stage's {doc['stage_layers']} layers: ring sends "
        f"{formulas.human(doc['ring_bytes_per_stage'])} ({formulas.human(doc['ring_bytes_per_layer'])} a layer), "
        "attention activations saved "
        f"{formulas.human(doc['saved_bytes_per_stage'])}"
    )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        setup = setup_from(args)
    except ParallelConfigError as error:
        print(f"reference.measure.scale: error: {error}", file=sys.stderr)
        return 2
    doc = document(setup)
    print(json.dumps(doc) if args.json else format_document(doc))
    return 0 if doc["agree"] else 1
