"""Test-side helpers of the distributed reference tests: re-assembly of sharded tensors, the single-process GPT
oracle, comparisons, the process groups a block made destroyed after it."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import runpy
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist

from reference.__main__ import main as demo_main
from reference.gpt.hf_weights import master_name
from reference.gpt.model import GPT, GPTConfig
from reference.gpt.train import synthetic_batches
from reference.measure.torch_patches import live_process_groups


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


@contextlib.contextmanager
def megatron_parallel_state(**sizes) -> Iterator[None]:
    """megatron's `initialize_model_parallel(**sizes)` for the body (without its gloo groups), then
    `destroy_model_parallel()` and every group it made destroyed: megatron only forgets them (every rank enters
    and leaves it together)."""
    from megatron.core import parallel_state

    with groups_of_the_block():
        parallel_state.initialize_model_parallel(**sizes, create_gloo_process_groups=False)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()


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
    """What the single-process GPT did: each step's loss, the gradients of step 1, the final weights."""

    losses: list[float]
    first_grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


@functools.cache
def unsharded_gpt_training(config: GPTConfig, seed: int, steps: int, lr: float, global_batch: int) -> UnshardedRun:
    """The single-process GPT after `steps` SGD steps on the synthetic batches: what every sharded
    run of the same model, seed and data must reproduce (computed once a process; the tensors are shared, read
    them only). Parameters are named as `named_parameters` names them, so a tied output weight appears once."""
    return sgd_steps(
        GPT(config, seed),
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
    DTensor counterpart of the reference block the TP and FSDP x TP tests compare against."""
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


def every_rank(result):
    """`result` of every rank of the default group, in rank order (for claims that compare ranks)."""
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def rank0(value):
    """Rank 0's `value`, on every rank."""
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def captured_stdout() -> Iterator[io.StringIO]:
    """What the block prints, kept; printed after all if the block raises (into the rank's log of the test)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured):
            yield captured
    except BaseException:
        print(captured.getvalue(), end="")
        raise


def demo_output(argv: list[str]) -> str:
    """Rank 0's stdout of `torchrun -m reference ARGV`, run in this process on the default group (the demo runs
    on the group it finds set up and leaves it), on every rank. `--device` is the group's, so `auto` cannot pick
    CUDA for a gloo group on a machine with a GPU."""
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    with captured_stdout() as captured:
        demo_main([*argv, "--device", device])
    return rank0(captured.getvalue())


BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def bench_report(script: str, args: list[str]) -> dict:
    """The JSON report (`--json`) that `python benchmarks/SCRIPT ARGS` prints, run in this process (runpy, as
    `__main__`) on the group it finds set up and leaves (reference.distributed.distributed), on every rank."""
    argv, path = sys.argv, sys.path
    sys.argv, sys.path = [str(BENCHMARKS / script), *args], [str(BENCHMARKS), *sys.path]  # as for a script there
    try:
        with captured_stdout() as captured:
            runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        sys.argv, sys.path = argv, path
    return json_lines("".join(every_rank(captured.getvalue())))[0]


@contextlib.contextmanager
def shared_tmp_dir() -> Iterator[Path]:
    """A temporary directory every rank of the default group writes into (made and removed by rank 0)."""
    path = Path(rank0(tempfile.mkdtemp(prefix="ranks-") if dist.get_rank() == 0 else None))
    try:
        yield path
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(path)


def json_lines(stdout: str) -> list[dict]:
    """The demo's (or a benchmark's) --json records: the lines of its output that are JSON objects."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
