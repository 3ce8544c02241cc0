"""HF `Qwen2ForCausalLM` under the document's DTensor plans (benchmarks/qwen2_dtensor.py) against the unsharded
HF model, on CPU/gloo or CUDA/NCCL (REFERENCE_TEST_DEVICE). Usage: OUT [uneven]; results() runs what the world
checks:

- world 2: the TP plan, the sequence-parallel plan, HF's own plan; the three pitfalls and their fixes,
  and what else the SP plan needs on HF Qwen2 (positions passed in, SDPA attention).
- world 4 (dp 2 x tp 2): FSDP2 with checkpointed layers and the SP plan, fp32 and bf16 compute.
- `uneven` (world 2, its own launch): the SP plan on a sequence TP does not divide; expected to crash
  (pitfall 2).

Each rank writes OUT/rank{R}.json: loss and gradient differences, and the collectives `CommDebugMode` counted
per decoder layer and per step, phase by phase.
"""

from __future__ import annotations

import copy
import sys
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import device_type, max_diff, serve
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import PrepareModuleInput, loss_parallel, parallelize_module

from benchmarks import qwen2_dtensor as qwen2
from reference.distributed import distributed

SEED, DATA_SEED, BATCH, SEQ = 0, 1, 4, 8
# CommDebugMode's op names (functional collectives from DTensor, c10d ops from FSDP2) -> the collective's kind
OP_NAMES = {
    "all_reduce": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "allreduce_": "all_reduce",
}


def batch(device: torch.device, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, next-token labels, positions), the same on every rank."""
    generator = torch.Generator().manual_seed(DATA_SEED)
    ids = torch.randint(0, qwen2.tiny_config().vocab_size, (BATCH, seq), generator=generator)
    return ids.to(device), qwen2.shift_labels(ids).to(device), torch.arange(seq, device=device).unsqueeze(0)


def full_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's whole gradient under its HF name (DTensor shards gathered, checkpoint wrapper removed)."""
    return {
        name.replace("_checkpoint_wrapped_module.", ""): (
            p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        ).float()
        for name, p in model.named_parameters()
    }


def partial_grads(model: torch.nn.Module) -> list[str]:
    """Parameters whose gradient is still an unreduced Partial sum after backward (left for a later reduction)."""
    return sorted(
        name.replace("_checkpoint_wrapped_module.", "")
        for name, p in model.named_parameters()
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)
    )


def counts(comm: CommDebugMode, fqn: str) -> dict[str, dict[str, int]]:
    """{phase: {collective: count}} that `comm` attributed to module `fqn` ("Global" for the whole step)."""
    per_phase, result = comm.comm_module_counts.get(fqn, {}), {}
    for phase in ("forward", "backward"):
        tally = Counter()
        for op, n in per_phase.get(phase, {}).items():
            tally[OP_NAMES.get(op.__name__, op.__name__)] += n
        result[phase] = dict(sorted(tally.items()))
    return result


def step_record(model, oracle_loss, oracle_grads, ids, labels, positions, dp_group=None) -> dict:
    """One forward/backward of `model` under CommDebugMode, compared with the unsharded oracle."""
    with CommDebugMode() as comm:
        loss = qwen2.loss_and_backward(model, ids, labels, positions)
    if dp_group is not None:  # data parallel: the oracle's loss is the mean over the DP ranks' batches
        dist.all_reduce(loss, group=dp_group)
        loss /= dp_group.size()
    layers = len(model.model.layers)
    return {
        "loss_diff": (loss.float() - oracle_loss).abs().item(),
        "grad_diff": max_diff(full_grads(model), oracle_grads),
        "grad_dtypes": sorted({str(p.grad.dtype) for p in model.parameters()}),
        "partial_grads": partial_grads(model),
        "step": counts(comm, "Global"),
        "blocks": [counts(comm, f"{type(model).__name__}.model.layers.{i}") for i in range(layers)],
    }


def oracle(base, ids, labels, positions) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = copy.deepcopy(base)
    return qwen2.loss_and_backward(model, ids, labels, positions), full_grads(model)


def error_of(action) -> str:
    """'ExceptionType: message' of what `action()` raises (the test asserts it raised)."""
    try:
        action()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def run_tp(device: torch.device) -> dict:
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    base = qwen2.build(qwen2.tiny_config(), SEED).to(device)
    ids, labels, positions = batch(device)
    oracle_loss, oracle_grads = oracle(base, ids, labels, positions)
    result = {}
    for config, apply in (
        ("tp", lambda m: qwen2.document_plan(m, mesh, sequence_parallel=False)),
        ("sp", lambda m: qwen2.document_plan(m, mesh, sequence_parallel=True)),
        ("hf", lambda m: qwen2.hf_plan(m, mesh)),
    ):
        model = apply(copy.deepcopy(base))
        result[config] = step_record(model, oracle_loss, oracle_grads, ids, labels, positions)
        with torch.no_grad():
            logits = model(input_ids=ids, position_ids=positions).logits
        result[config]["logits"] = {
            "dtensor": isinstance(logits, DTensor),
            "local_shape": list((logits.to_local() if isinstance(logits, DTensor) else logits).shape),
        }
    result["pitfall_positional"] = pitfall_positional(base, mesh, ids, positions)
    result["pitfall_uneven_fix"] = pitfall_uneven_fix(base, mesh, device)
    result["pitfall_dtensor_loss"] = pitfall_dtensor_loss(base, mesh, ids, labels, positions)
    result["eager_mask"] = eager_mask(mesh, device, ids, positions)
    sp_model = qwen2.document_plan(copy.deepcopy(base), mesh, sequence_parallel=True)
    result["positions_missing"] = {"error": error_of(lambda: sp_model(input_ids=ids))}  # HF derives them locally
    return result


def pitfall_positional(base, mesh, ids, positions) -> dict:
    """Pitfall 1: attention's input layout given positionally, while the decoder layer passes hidden_states=..."""
    plan = qwen2.block_plan(sequence_parallel=True)
    plan["self_attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    parallelize_module(model, mesh, qwen2.top_plan(sequence_parallel=True))
    return {"error": error_of(lambda: model(input_ids=ids, position_ids=positions))}


def eager_mask(mesh, device, ids, positions) -> dict:
    """Not in the document: under the SP plan, HF builds the causal mask from the embedding's output, which is
    this rank's sequence shard; eager attention adds that mask to full-sequence scores, SDPA needs none."""
    model = qwen2.build(qwen2.tiny_config(attn_implementation="eager"), SEED).to(device)
    qwen2.document_plan(model, mesh, sequence_parallel=True)
    return {"error": error_of(lambda: model(input_ids=ids, position_ids=positions))}


def pitfall_uneven_fix(base, mesh, device) -> dict:
    """Pitfall 2's fix: a 7-token sequence padded to 8 (labels ignored, positions continued) under SP gives the
    unpadded unsharded model's loss and gradients."""
    ids, labels, positions = batch(device, seq=SEQ - 1)
    oracle_loss, oracle_grads = oracle(base, ids, labels, positions)
    tp = mesh.size()
    padded = (
        qwen2.pad_to_multiple(ids, tp, 0),
        qwen2.pad_to_multiple(labels, tp, qwen2.IGNORE_INDEX),
        torch.arange(qwen2.pad_to_multiple(ids, tp, 0).size(1), device=device).unsqueeze(0),
    )
    model = qwen2.document_plan(copy.deepcopy(base), mesh, sequence_parallel=True)
    record = step_record(model, oracle_loss, oracle_grads, *padded)
    return {
        "seq": ids.size(1),
        "padded_seq": padded[0].size(1),
        "loss_diff": record["loss_diff"],
        "grad_diff": record["grad_diff"],
    }


def pitfall_dtensor_loss(base, mesh, ids, labels, positions) -> dict:
    """Pitfall 3: `dist.all_reduce` of the loss `loss_parallel` returns (a DTensor), then the fix: reduce its
    local tensor."""
    model = qwen2.document_plan(copy.deepcopy(base), mesh, sequence_parallel=False)
    logits = model(input_ids=ids, position_ids=positions).logits
    with loss_parallel():
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=qwen2.IGNORE_INDEX)
    error = error_of(lambda: dist.all_reduce(loss))
    local = loss.to_local().detach().clone()
    dist.all_reduce(local)
    return {
        "loss_type": type(loss).__name__,
        "placements": [str(p) for p in loss.placements],
        "error": error,
        "fixed_mean_diff": (local / dist.get_world_size() - loss.to_local()).abs().item(),
    }


def run_fsdp_tp(device: torch.device) -> dict:
    """The document's working configuration on dp 2 x tp 2; each DP rank trains on its half of the batch."""
    mesh = init_device_mesh(device.type, (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    base = qwen2.build(qwen2.tiny_config(), SEED).to(device)
    ids, labels, positions = batch(device)
    oracle_loss, oracle_grads = oracle(base, ids, labels, positions)
    dp_rank, dp_group = mesh["dp"].get_local_rank(), mesh["dp"].get_group()
    mine = [t.chunk(2)[dp_rank] for t in (ids, labels)]
    result = {}
    for config, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = qwen2.fsdp2_2d(copy.deepcopy(base), mesh, sequence_parallel=True, param_dtype=dtype)
        result[config] = step_record(model, oracle_loss, oracle_grads, *mine, positions, dp_group=dp_group)
    return result


def run_uneven(device: torch.device) -> None:
    """Pitfall 2: a 7-token sequence under the SP plan at TP 2 (no padding); gloo aborts the job."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = qwen2.document_plan(qwen2.build(qwen2.tiny_config(), SEED).to(device), mesh, sequence_parallel=True)
    ids, labels, positions = batch(device, seq=SEQ - 1)
    qwen2.loss_and_backward(model, ids, labels, positions)
    print(f"rank {dist.get_rank()}: a {SEQ - 1}-token sequence ran under SP at TP {mesh.size()}", flush=True)


def results(device: torch.device) -> dict:
    """What this world checks: `tp` at world 2, `fsdp_tp` at world 4."""
    modes = {2: run_tp, 4: run_fsdp_tp}
    assert dist.get_world_size() in modes, "run on 2 or 4 ranks"
    return {**modes[dist.get_world_size()](device), "rank": dist.get_rank()}


def main() -> None:
    """`OUT` serves results(); `OUT uneven` runs pitfall 2, whose crash its test expects (a short collective
    timeout, so a survivor does not wait long)."""
    if sys.argv[2:] == ["uneven"]:
        with distributed(device_type(), timeout_s=30) as device:
            run_uneven(device)
    else:
        serve(results)


if __name__ == "__main__":
    main()
