"""Forward+backward time and bytes per step of the Llama/Qwen2 block: the reference vs Hugging Face's own
Qwen2ForCausalLM under the same DTensor TP plan, one run.

    torchrun --nproc-per-node 2 benchmarks/bench_decoder.py [--sequence-parallel] [--hidden-size 256 ...]

Both hold the same weights (the HF model's, loaded into the reference's "llama" style by
reference.gpt.hf_weights) on the same ranks, and run interleaved step by step so that machine noise hits
them alike; rank 0 prints the medians, the bytes each sent per step (one recorded step each, by the
CollectiveRecorder) and the ratios reference / HF, plus the two losses (equal up to fp32 order).
  * reference: reference.gpt.parallelize's build_stage, style "llama", TP over the whole world (vocab-parallel
               embedding and head, Megatron's cross-entropy), optionally sequence-parallel
  * hf:        the document's DTensor plan (reference/hf_tp/plan.py::document_plan: q/k/v and gate/up
               colwise, o and down rowwise, embedding rowwise, head colwise kept as a DTensor for
               loss_parallel), SDPA attention
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist
from _harness import add_sizes, interleaved_times
from torch.distributed.device_mesh import init_device_mesh
from transformers import Qwen2ForCausalLM

from reference.arguments import add_device_argument
from reference.distributed import distributed, one_line_errors
from reference.gpt.hf_weights import load_hf_into_stage, qwen2_config
from reference.gpt.model import GPTConfig
from reference.gpt.parallelize import build_stage
from reference.gpt.train import synthetic_batches
from reference.hf_tp.plan import document_plan, loss_and_backward
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sizes(parser, batch_size=4, seq_length=128, hidden_size=256, num_attention_heads=8, num_kv_heads=2)
    add_sizes(parser, num_layers=2, vocab_size=1024)
    parser.add_argument("--rounds", type=int, default=20, help="rounds; each times one step of both, in turn")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_device_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with one_line_errors("bench_decoder"), distributed(args.device) as device:
        config = GPTConfig.from_sizes(args, style="llama", num_kv_heads=args.num_kv_heads)
        world = dist.get_world_size()
        torch.manual_seed(0)
        hf = Qwen2ForCausalLM(qwen2_config(config, attn_implementation="sdpa")).to(device)
        stage = build_stage(
            config, build_layout(tp_size=world), sequence_parallel=args.sequence_parallel, device=device
        )
        load_hf_into_stage(stage, hf.state_dict())
        document_plan(hf, init_device_mesh(device.type, (world,)), args.sequence_parallel)
        tokens = synthetic_batches(config, 1, args.batch_size, 0)[0].to(device)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        positions = torch.arange(config.seq_length, device=device).expand(args.batch_size, -1)

        def reference_step() -> float:
            loss = stage(inputs, labels)
            loss.backward()
            stage.zero_grad()
            return loss.item()

        def hf_step() -> float:
            loss = loss_and_backward(hf, inputs, labels, positions)
            hf.zero_grad()
            return loss.item()

        steps = {"reference": reference_step, "hf": hf_step}
        losses, nbytes = {}, {}
        for name, step in steps.items():  # one recorded step each: warm-up, loss and bytes
            with CollectiveRecorder() as rec:
                losses[name] = step()
            nbytes[name] = sum(e.nbytes for e in rec.events)
        times = interleaved_times(steps, args.rounds, device.type == "cuda")
        if dist.get_rank() != 0:
            return
        report = {
            "tp": world,
            "device": device.type,
            "sequence_parallel": args.sequence_parallel,
            "losses": losses,
            "median_s": {n: statistics.median(t) for n, t in times.items()},
            "bytes_per_step": nbytes,
        }
        report["ratios"] = {"time reference/hf": report["median_s"]["reference"] / report["median_s"]["hf"]}
        if nbytes["hf"]:  # TP 1 (one rank, e.g. one GPU) sends nothing
            report["ratios"]["bytes reference/hf"] = nbytes["reference"] / nbytes["hf"]
        if args.json:
            print(json.dumps(report), flush=True)
            return
        print(
            f"TP {world}{' + SP' if args.sequence_parallel else ''}, b {args.batch_size} s {args.seq_length} "
            f"h {args.hidden_size}, {args.num_attention_heads} heads / {args.num_kv_heads} KV heads, "
            f"{args.num_layers} layers, {args.rounds} rounds, on {device.type}"
        )
        for name in steps:
            print(
                f"  {name:9s} median {report['median_s'][name] * 1e3:8.2f} ms  {nbytes[name]:>10,} B/step  "
                f"loss {losses[name]:.6f}"
            )
        print("  ratios: " + ", ".join(f"{k} {v:.2f}" for k, v in report["ratios"].items()), flush=True)


if __name__ == "__main__":
    main()
