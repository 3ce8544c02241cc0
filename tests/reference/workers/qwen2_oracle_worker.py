"""Worker for test_qwen2_oracle.py: `torchrun --nproc-per-node W qwen2_oracle_worker.py OUTDIR` (W = 1, 2 or 4).

The oracle is transformers' own Qwen2ForCausalLM, built from a tiny config with random weights (biases and
RMSNorm weights randomized too), loaded into the reference's "llama" style by reference.gpt.hf_weights.
  W 1 and 2: the unsharded reference and a TP = W stage (plain, sequence-parallel, and sequence-parallel on
             a sequence length TP does not divide): logits, loss and every gradient against Hugging Face's,
             and the stage's collectives per phase.
  W 4:       TP 2 x DP 2, DDP-replicated and FSDP-sharded (with SP; fp32, and bf16 compute with fp32
             shards and fp32 reduce-scatters), and TP 2 x PP 2 (1F1B, 2 micro-batches, SP on an uneven
             sequence): the losses of STEPS SGD steps against Hugging Face trained on the global batch, and
             (DDP) every parameter of the stage after them.
Each rank writes OUTDIR/rank{r}.json.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import max_diff, serve
from transformers import Qwen2ForCausalLM

from reference.fsdp import MixedPrecision
from reference.gpt.hf_weights import load_hf_into_stage, master_state_from_hf, qwen2_config, stage_state_from_master
from reference.gpt.model import GPTConfig, UnshardedGPT
from reference.gpt.parallelize import build_stage
from reference.gpt.train import data_parallel, fully_sharded, synthetic_batches, train_step
from reference.measure.recorder import CollectiveRecorder
from reference.parallel_state import build_layout
from reference.tensor_parallel.layers import allreduce_sequence_parallel_grads

CONFIG = GPTConfig(
    style="llama",
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_kv_heads=2,
    num_layers=2,
    seq_length=12,
    ffn_hidden_size=96,
)
UNEVEN = dataclasses.replace(CONFIG, seq_length=11)  # not divisible by TP 2 (nor 4)
B, SEED, STEPS, LR = 4, 1234, 2, 0.5
DEVICE = torch.device("cpu")  # results() sets it: cuda under REFERENCE_TEST_DEVICE=cuda


def hf_model(config: GPTConfig) -> Qwen2ForCausalLM:
    torch.manual_seed(SEED)
    model = Qwen2ForCausalLM(qwen2_config(config)).to(DEVICE)
    with torch.no_grad():  # HF initializes biases to 0 and norms to 1: make them matter
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
    return model


def tokens_of(config: GPTConfig, steps: int = 1) -> list[torch.Tensor]:
    return synthetic_batches(config, steps, B, SEED)


def hf_step(model: Qwen2ForCausalLM, config: GPTConfig, tokens: torch.Tensor):
    """Logits [b, s, V], mean token loss, and the gradients in the reference's unsharded names."""
    model.zero_grad()
    tokens = tokens.to(DEVICE)
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = master_state_from_hf(config, {n: p.grad for n, p in model.named_parameters()})
    return logits.detach(), loss.item(), grads


def unsharded(config: GPTConfig) -> dict:
    hf = hf_model(config)
    tokens = tokens_of(config)[0].to(DEVICE)
    logits, loss, grads = hf_step(hf, config, tokens)
    ref = UnshardedGPT(config, SEED, device=DEVICE)
    ref.load_state_dict(master_state_from_hf(config, hf.state_dict()))
    ours = ref.logits(tokens[:, :-1]).transpose(0, 1)
    our_loss = ref(tokens[:, :-1], tokens[:, 1:])
    our_loss.backward()
    return {
        "logits": (ours - logits).abs().max().item(),
        "loss": abs(our_loss.item() - loss),
        "grads": max_diff({n: p.grad for n, p in ref.named_parameters()}, grads),
        "hf_loss": loss,
    }


def tp_stage(config: GPTConfig, layout, sp: bool) -> dict:
    """One TP stage (the whole model) against HF: this rank's logit columns, the loss, its gradient shards."""
    hf = hf_model(config)
    tokens = tokens_of(config)[0].to(DEVICE)
    logits, loss, grads = hf_step(hf, config, tokens)
    stage = build_stage(config, layout, sequence_parallel=sp, seed=SEED, device=DEVICE)
    load_hf_into_stage(stage, hf.state_dict())
    tp, r = layout.tp_size, layout.tp_rank
    with torch.no_grad():
        our_logits = stage.logits(tokens[:, :-1])[: config.seq_length].transpose(0, 1)
    columns = our_logits.shape[-1]
    their_logits = logits[..., r * columns : (r + 1) * columns]
    rec = CollectiveRecorder()
    rec.watch(stage)
    with rec:
        our_loss = stage(tokens[:, :-1], tokens[:, 1:])
        our_loss.backward()
    allreduce_sequence_parallel_grads(stage, layout.tp_group)
    expected = stage_state_from_master(stage, grads)
    return {
        "logits": (our_logits - their_logits).abs().max().item(),
        "loss": abs(our_loss.item() - loss),
        "grads": max_diff({n: p.grad for n, p in stage.named_parameters()}, expected),
        "tp": tp,
        "events": [[e.op, e.module, e.phase, e.nbytes] for e in rec.events],
        "activation_bytes": stage.seq_length * B * config.hidden_size * 4,
    }


def hf_train(config: GPTConfig, batches: list[torch.Tensor]) -> tuple[Qwen2ForCausalLM, list[float]]:
    hf = hf_model(config)
    optimizer = torch.optim.SGD(hf.parameters(), lr=LR)
    losses = []
    for tokens in batches:
        losses.append(hf_step(hf, config, tokens)[1])
        optimizer.step()
    return hf, losses


def tp_dp(
    layout, sharding: str, sp: bool, bf16: bool = False, config: GPTConfig = CONFIG, micro_batches: int = 1
) -> dict:
    """STEPS SGD steps of a TP x PP x DP layout against HF on the global batch; with DDP, the parameters after
    them (this stage's)."""
    batches = tokens_of(config, STEPS)
    hf, hf_losses = hf_train(config, batches)
    stage = build_stage(config, layout, sequence_parallel=sp, seed=SEED, device=DEVICE)
    load_hf_into_stage(stage, hf_model(config).state_dict())
    if sharding == "fsdp":
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        model = fully_sharded(stage, layout, mixed_precision=mp)
    else:
        model = data_parallel(stage, layout)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, dp_events = [], []
    dp_ranks = tuple(dist.get_process_group_ranks(layout.dp_group))
    for tokens in batches:
        rec = CollectiveRecorder()
        losses.append(
            train_step(model, optimizer, tokens, layout, num_micro_batches=micro_batches, device=DEVICE, record=rec)
        )
        dp_events = [(e.op, e.dtype) for e in rec.events if e.group_ranks == dp_ranks]
    out = {
        "losses": losses,
        "hf_losses": hf_losses,
        "dp_ops": sorted(set(dp_events)),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
    }
    if sharding == "ddp":
        expected = stage_state_from_master(stage, master_state_from_hf(config, hf.state_dict()))
        out["params"] = max_diff({n: p.detach() for n, p in stage.named_parameters()}, expected)
    return out


def results(device: torch.device) -> dict:
    """What this world checks: W 1 and 2 the unsharded model and TP stages, W 4 TP x DP and TP x PP training."""
    global DEVICE
    DEVICE = device
    world = dist.get_world_size()
    result: dict = {"world": world}
    if world in (1, 2):
        layout = build_layout(tp_size=world)
        if world == 1:
            result["unsharded"] = unsharded(CONFIG)
            result["unsharded_uneven"] = unsharded(UNEVEN)
        result["tp"] = tp_stage(CONFIG, layout, sp=False)
        result["tp_sp"] = tp_stage(CONFIG, layout, sp=True)
        result["tp_sp_uneven"] = tp_stage(UNEVEN, layout, sp=True)
    else:
        layout = build_layout(tp_size=2, dp_size=world // 2)
        result["ddp"] = tp_dp(layout, "ddp", sp=False)
        result["ddp_sp"] = tp_dp(layout, "ddp", sp=True)
        result["fsdp_sp"] = tp_dp(layout, "fsdp", sp=True)
        result["fsdp_sp_bf16"] = tp_dp(layout, "fsdp", sp=True, bf16=True)
        pipeline = build_layout(tp_size=2, pp_size=world // 2)
        result["pp_sp_uneven"] = tp_dp(pipeline, "ddp", sp=True, config=UNEVEN, micro_batches=2)
    return result


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()
