"""Helpers shared by the worker scripts: process-group setup, the results file, re-assembly of sharded tensors.

The worker protocol (tests/launch.run_worker): `main()` under `if __name__ == "__main__"`, the output folder as
first argument, each rank's results written by `write_results` for the pytest side to assert on. Most workers
define `results(device) -> dict` and `main()` calls `serve(results)`, so shared_worker.py can run several of
them in one launch.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from reference.distributed import finish, init_distributed
from reference.gpt.hf_weights import master_name
from reference.gpt.model import GPTConfig, UnshardedGPT
from reference.gpt.train import synthetic_batches
from reference.torch_patches import live_process_groups


def device_type() -> str:
    """The device the test launched this worker for (REFERENCE_TEST_DEVICE, set by run_worker): cpu or cuda."""
    return "cuda" if os.environ.get("REFERENCE_TEST_DEVICE") == "cuda" else "cpu"


def init(timeout_s: int = 60) -> torch.device:
    """gloo on CPU, or nccl on CUDA when REFERENCE_TEST_DEVICE=cuda; returns the device."""
    return init_distributed(device_type(), timeout_s)


def write_results(out: str | Path, results: dict) -> None:
    """This rank's results as OUT/rank{R}.json, the one way a worker reports to its test."""
    (Path(out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))


@contextlib.contextmanager
def groups_of_the_block() -> Iterator[None]:
    """Destroy, after the body, every process group it created (every rank enters and leaves it together; also
    a decorator).
    torch keeps a group until it is destroyed, and each gloo group keeps a thread waking every 10 ms to poll its
    sockets: megatron's destroy_model_parallel only forgets its dozens of groups, and a launch that built and
    forgot them config after config ran about 240 such threads a rank, half its CPU time in the kernel."""
    before = set(live_process_groups())
    yield  # not on an exception: that rank is going down, and a barrier here would only wait for the others
    dist.barrier()  # every rank is done with the groups before any rank tears its end down
    for group in live_process_groups():
        if group not in before:
            dist.destroy_process_group(group)


def serve(results: Callable[[torch.device], dict]) -> None:
    """A worker's main: set up the process group, write this rank's `results(device)` to the output folder
    given as first argument, tear the group down."""
    out = Path(sys.argv[1])
    device = init()
    write_results(out, results(device))
    finish()


def gather_dim(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (test-side re-assembly, independent of the reference)."""
    parts = [torch.empty_like(t) for _ in range(group.size())]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def full_tensor(module_name: str, param_name: str, t: torch.Tensor, group) -> torch.Tensor:
    """The unsharded version of a TP block parameter (or its gradient), by the layer it belongs to."""
    if module_name.endswith(("qkv", "fc1")):  # column-parallel: weight and bias split on dim 0
        return gather_dim(t, 0, group)
    if module_name.endswith(("proj", "fc2")) and param_name == "weight":  # row-parallel weight: dim 1
        return gather_dim(t, 1, group)
    return t  # replicated: LayerNorm, row bias


class UnshardedRun(NamedTuple):
    """What the single-process UnshardedGPT did: each step's loss, the gradients of step 1, the final weights."""

    losses: list[float]
    first_grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


@functools.cache
def unsharded_gpt_training(config: GPTConfig, seed: int, steps: int, lr: float, global_batch: int) -> UnshardedRun:
    """The single-process UnshardedGPT after `steps` SGD steps on the synthetic batches: what every sharded
    run of the same model, seed and data must reproduce (computed once a process; the tensors are shared, read
    them only). Parameters are named as `named_parameters` names them, so a tied output weight appears once."""
    return sgd_steps(
        UnshardedGPT(config, seed),
        synthetic_batches(config, steps, global_batch, seed),
        lambda model, tokens: model(tokens[:, :-1], tokens[:, 1:]),
        lr,
    )


def sgd_steps(model: torch.nn.Module, batches, loss_of, lr: float) -> UnshardedRun:
    """`model` trained in one process, an SGD step per batch (`loss_of(model, batch)`): the oracle a sharded
    run of the same model and data must reproduce."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    losses, first_grads = [], {}
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        first_grads = first_grads or {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return UnshardedRun(losses, first_grads, {name: p.detach().clone() for name, p in model.named_parameters()})


def full_stage_parameters(stage: torch.nn.Module, tp_group, vocab_size: int) -> dict[str, torch.Tensor]:
    """Every parameter of a parallelized GPT stage (or model chunk) unsharded, on the CPU, under the whole
    GPT's names."""
    full = {}
    for name, param in stage.named_parameters():
        if "word_embeddings" in name or name.startswith("output_layer"):  # vocabulary rows, padded to V_p
            tensor = gather_dim(param.detach(), 0, tp_group)[:vocab_size]
        else:
            module, pname = name.rsplit(".", 1)
            tensor = full_tensor(module, pname, param.detach(), tp_group)
        full[master_name(stage, name)] = tensor.cpu()
    return full


def assert_close(actual, expected, what: str, atol=1e-5, rtol=1e-4):
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def dtensor_plan(sp: bool) -> dict:
    """PyTorch's own TP plan for one plain TransformerBlock (parallelize_module), with or without SP: the
    DTensor counterpart of the reference block the TP and FSDP x TP workers compare against."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if not sp:
        return {
            "attention.qkv": ColwiseParallel(),
            "attention.proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(),
            "mlp.fc2": RowwiseParallel(),
        }
    return {
        "ln1": SequenceParallel(sequence_dim=0),
        "attention.qkv": ColwiseParallel(input_layouts=Shard(0)),
        "attention.proj": RowwiseParallel(output_layouts=Shard(0)),
        "ln2": SequenceParallel(sequence_dim=0),
        "mlp.fc1": ColwiseParallel(input_layouts=Shard(0)),
        "mlp.fc2": RowwiseParallel(output_layouts=Shard(0)),
    }


def max_diff(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> float:
    """Largest absolute difference over same-named tensors (compared in fp32); the names must match."""
    assert ours.keys() == theirs.keys(), f"parameter names differ: {sorted(ours.keys() ^ theirs.keys())}"
    return max((ours[n].float() - theirs[n].float()).abs().max().item() for n in ours)
