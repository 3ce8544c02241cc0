"""Megatron's mixed precision and the distributed optimizer (ZeRO-1) in reference.data_parallel.

At 4 CPU ranks, the first test to ask (`results()`, once a rank) trains the bf16 test transformer (hidden 16,
an odd MLP width 61 so that buckets need padding) with Adam for three steps at DP 4 and DP 2, with the
unsharded mixed precision optimizer (the oracle: fp32 main_grad all-reduced, fp32 masters of every parameter on
every rank) and with the distributed optimizer (reduce-scatter, step this rank's slice, all-gather), with and
without overlapping the all-gathers with the next forward, with fp32 and with bf16 gradients. At 2 ranks
(`megatron_results()`), megatron-core 0.16.1's own DistributedDataParallel and DistributedOptimizer train a
bf16 MLP next to the reference's, and megatron's GPTModel ties its embedding at PP 2; on the CPU, megatron's
CUDA calls redirected (reference.measure.torch_patches.cuda_calls_on_cpu, CudaTypeNames).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from reference.data_parallel import DistributedDataParallel, local_batch
from reference.data_parallel.buckets import padded_numel
from reference.data_parallel.distributed_optimizer import DistributedOptimizer, bytes_per_rank
from reference.data_parallel.mixed_precision import unsharded
from reference.gpt.model import gpt_blocks
from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import cuda_calls_on_cpu
from tests.ranks import on_ranks
from tests.reference import regression
from tests.reference.helpers import every_rank, max_diff, megatron_parallel_state

H, HEADS, LAYERS, S, B, STEPS, SEED, LR = 16, 4, 2, 8, 8, 3, 1234, 1e-3
FFN = 61  # an odd MLP width: buckets of odd sizes, so the slices need padding at DP 2 and 4
DEVICE = torch.device("cpu")
BUCKET = 4096  # bytes of bf16 parameters: several buckets, several slices per bucket
CONFIGS = {  # name: (use_distributed_optimizer, overlap_param_gather, fp32 gradients)
    "oracle": (False, False, True),
    "distopt": (True, False, True),
    "distopt/overlap_param_gather": (True, True, True),
    "oracle/bf16_grads": (False, False, False),
    "distopt/bf16_grads": (True, False, False),
}


def adam(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
    return torch.optim.Adam(tensors, lr=LR)


def train(group, config: str) -> dict:
    use_distopt, overlap_param_gather, fp32_grads = CONFIGS[config]
    torch.manual_seed(SEED)
    module = gpt_blocks(LAYERS, H, HEADS, ffn_hidden_size=FFN, params_dtype=torch.bfloat16, device=DEVICE)
    model = DistributedDataParallel(
        module,
        group,
        bucket_size=BUCKET,
        grad_dtype=torch.float32 if fp32_grads else None,
        use_distributed_optimizer=use_distopt,
        overlap_param_gather=overlap_param_gather,
    )
    optimizer = DistributedOptimizer(model, adam) if use_distopt else unsharded(model, adam)
    losses, steps, facts = [], [], {}
    for x, target in regression.batches(STEPS, S, B, H):
        with CollectiveRecorder() as rec:
            out = model(None, None, hidden=local_batch(x, group, dim=1).to(torch.bfloat16))
            loss = regression.mse(out.float(), local_batch(target, group, dim=1))
            loss.backward()
            if not facts:
                facts = {
                    "param_dtype": str(next(module.parameters()).dtype),
                    "grad_is_none": all(p.grad is None for p in module.parameters()) if fp32_grads else None,
                    "main_grad_dtype": str(next(module.parameters()).main_grad.dtype) if fp32_grads else None,
                    "master_dtypes": sorted({str(m.dtype) for m in optimizer.masters}),
                }
            model.finish_grad_sync()
            with rec.scope("step"):
                optimizer.step()
            model.zero_grad()
        steps.append(
            [
                {
                    "op": e.op,
                    "group": list(e.group_ranks),
                    "nbytes": e.nbytes,
                    "dtype": e.dtype,
                    "phase": e.phase,
                    "in_step": e.module == "step",
                }
                for e in rec.events
            ]
        )
        losses.append(regression.mean_over(loss.item(), group))
    model.finish_param_sync()
    params = {n: p.detach().clone() for n, p in module.named_parameters()}
    masters = flat_masters(model, optimizer, use_distopt)
    rounded = [m.to(torch.bfloat16) for m in masters]
    model_flat = [
        bucket.shard if use_distopt else torch.cat([p.detach().reshape(-1) for p in bucket.params])
        for bucket in (model.param_buckets or model.buckets)
    ]
    facts["master_rounds_to_param"] = all(torch.equal(r, p) for r, p in zip(rounded, model_flat))
    facts["master_finer_than_param"] = sum(int((m != p.float()).sum()) for m, p in zip(masters, model_flat))
    numel = sum(b.numel for b in model.buckets)
    padded = sum(padded_numel(b.numel, group.size()) for b in model.buckets)
    return {
        "losses": losses,
        "steps": steps,
        "params": params,
        "masters": masters,
        "facts": facts,
        "bytes": bytes_per_rank(model, optimizer),
        "numel": numel,
        "padded_numel": padded,
        "buckets": len(model.buckets),
    }


def flat_masters(model, optimizer, use_distopt: bool) -> list[torch.Tensor]:
    """Per bucket, the fp32 masters this rank holds: its slice (distributed), or the bucket's parameters'
    masters laid end to end (unsharded)."""
    if use_distopt:
        return [m.detach().clone() for m in optimizer.masters]
    by_param = dict(zip(optimizer.model_tensors, optimizer.masters))
    return [torch.cat([by_param[p].reshape(-1) for p in bucket.params]) for bucket in model.buckets]


def compare(run: dict, oracle: dict, group) -> dict:
    """Largest differences of `run` from `oracle`: bf16 parameters, this rank's fp32 master slices, losses."""
    size, rank = group.size(), group.rank()
    slices = []
    for full in oracle["masters"]:
        padded = torch.cat([full, full.new_zeros(padded_numel(full.numel(), size) - full.numel())])
        slices.append(padded.chunk(size)[rank])
    return {
        "params": max_diff(run["params"], oracle["params"]),
        "params_bitwise": all(torch.equal(run["params"][n], oracle["params"][n]) for n in oracle["params"]),
        "masters": max((a - b).abs().max().item() for a, b in zip(run["masters"], slices)),
        "losses": max(abs(a - b) for a, b in zip(run["losses"], oracle["losses"])),
    }


def bad_input(group) -> dict[str, str]:
    errors = {}

    def capture(key, fn):
        try:
            fn()
        except ValueError as error:
            errors[key] = str(error)

    plain = DistributedDataParallel(gpt_blocks(1, H, HEADS, device=DEVICE), group)
    capture("distopt_on_plain_ddp", lambda: DistributedOptimizer(plain, adam))
    capture(
        "overlap_param_gather_without_distopt",
        lambda: DistributedDataParallel(gpt_blocks(1, H, HEADS, device=DEVICE), group, overlap_param_gather=True),
    )
    sharded = DistributedDataParallel(gpt_blocks(1, H, HEADS, device=DEVICE), group, use_distributed_optimizer=True)
    capture("unsharded_on_sharded_ddp", lambda: unsharded(sharded, adam))
    return errors


DISTRIBUTED = ["distopt", "distopt/overlap_param_gather", "distopt/bf16_grads"]


@functools.cache
def results() -> dict:
    """This rank's view of every configuration at DP 4 and DP 2 with its differences from the oracle, and the
    bad-input errors (computed once a rank: the tests read it)."""
    halves, _ = dist.new_subgroups(2)
    result = {"rank": dist.get_rank(), "dp": {}}
    for dp, group in (("dp4", dist.group.WORLD), ("dp2", halves)):
        runs = {config: train(group, config) for config in CONFIGS}
        entry = {"size": group.size(), "runs": {}}
        for config, run in runs.items():
            oracle = runs["oracle/bf16_grads" if config.endswith("bf16_grads") else "oracle"]
            entry["runs"][config] = {
                "diff": compare(run, oracle, group) if run is not oracle else None,
                **{k: run[k] for k in ("steps", "facts", "bytes", "numel", "padded_numel", "buckets", "losses")},
            }
        result["dp"][dp] = entry
    result["bad_input"] = bad_input(dist.group.WORLD)
    return result


def runs(dp: str, config: str) -> dict:
    return results()["dp"][dp]["runs"][config]


def ops(step: list[dict], op: str) -> list[dict]:
    return [e for e in step if e["op"] == op]


@on_ranks(4)
@pytest.mark.parametrize("dp", ["dp2", "dp4"])
@pytest.mark.parametrize("config", DISTRIBUTED)
def test_distributed_optimizer_equals_the_unsharded_step_bit_for_bit(ranks, dp, config):
    """Reduce-scatter then all-gather sums the same terms in the same order as gloo's all-reduce, and Adam is
    elementwise, so slicing changes no bit: parameters, fp32 master slices and losses are equal."""
    diff = runs(dp, config)["diff"]
    assert diff["params_bitwise"] and diff["params"] == 0.0
    assert diff["masters"] == 0.0 and diff["losses"] == 0.0


@on_ranks(4)
def test_buckets_are_padded_to_a_multiple_of_the_dp_size(ranks):
    for dp, n in (("dp2", 2), ("dp4", 4)):
        run = runs(dp, "distopt")
        assert run["numel"] % n != 0 or run["padded_numel"] > run["numel"], "the test model needs padding"
        assert run["padded_numel"] % n == 0
        assert 0 < run["padded_numel"] - run["numel"] < n * run["buckets"]


@on_ranks(4)
@pytest.mark.parametrize("config", ["oracle", "distopt"])
def test_mixed_precision_keeps_bf16_parameters_fp32_main_grads_and_fp32_masters(ranks, config):
    facts = runs("dp2", config)["facts"]
    assert facts["param_dtype"] == "torch.bfloat16" and facts["main_grad_dtype"] == "torch.float32"
    assert facts["grad_is_none"], "the hook moves each bf16 .grad into main_grad and drops it"
    assert facts["master_dtypes"] == ["torch.float32"]
    assert facts["master_rounds_to_param"], "the bf16 parameter is its fp32 master rounded"
    assert facts["master_finer_than_param"] > 0, "the masters hold bits the bf16 parameters do not"


@on_ranks(4)
@pytest.mark.parametrize("dp, n", [("dp2", 2), ("dp4", 4)])
def test_bytes_per_rank_are_the_zero_paper_accounting(ranks, dp, n):
    """ZeRO (Rajbhandari et al. 2020), stage 1: 2Ψ bf16 parameters + 2Ψ bf16 gradients + 12Ψ/N optimizer
    (4 fp32 master + 4 + 4 Adam moments). Megatron with fp32 main gradients: 4Ψ of gradients, so 6Ψ + 12Ψ/N.
    Ψ is the padded bucket size (at most N - 1 elements per bucket more than the model)."""
    accounting = [  # (configuration, what Ψ counts, gradient bytes per parameter, ranks sharing the optimizer)
        ("distopt/bf16_grads", "padded_numel", 2, n),
        ("distopt", "padded_numel", 4, n),
        ("oracle", "numel", 4, 1),  # unsharded: 2 + 4 + 12 bytes per parameter on every rank
    ]
    for config, counted, gradient_bytes, shards in accounting:
        run = runs(dp, config)
        psi = run[counted]
        assert run["bytes"] == {
            "parameters": 2 * psi,
            "gradients": gradient_bytes * psi,
            "master_weights": 4 * psi // shards,
            "optimizer_states": 8 * psi // shards,
        }, config


@on_ranks(4)
@pytest.mark.parametrize("dp", ["dp2", "dp4"])
def test_traffic_per_step_reduce_scatter_plus_all_gather_is_an_all_reduce(ranks, dp):
    """Per rank a ring all-reduce moves 2(N-1)/N of its buffer, a reduce-scatter and an all-gather (N-1)/N
    each: with bf16 gradients the distributed optimizer sends what DDP sends; with fp32 gradients and bf16
    parameters 4 + 2 = 6 bytes per parameter against DDP's 8. Recorded nbytes are full-buffer sizes."""
    bf16, ddp, distopt = runs(dp, "oracle/bf16_grads"), runs(dp, "distopt/bf16_grads"), runs(dp, "distopt")
    psi, padded = distopt["numel"], distopt["padded_numel"]
    for step in range(len(bf16["steps"])):
        all_reduce = sum(e["nbytes"] for e in ops(bf16["steps"][step], "all_reduce"))
        assert all_reduce == 2 * psi
        both = ops(ddp["steps"][step], "reduce_scatter") + ops(ddp["steps"][step], "all_gather")
        assert sum(e["nbytes"] for e in both) == 2 * (2 * padded)  # = 2 x all-reduce bytes, padded
        fp32 = distopt["steps"][step]
        assert sum(e["nbytes"] for e in ops(fp32, "reduce_scatter")) == 4 * padded
        assert {e["dtype"] for e in ops(fp32, "reduce_scatter")} == {"float32"}
        assert sum(e["nbytes"] for e in ops(fp32, "all_gather")) == 2 * padded
        assert {e["dtype"] for e in ops(fp32, "all_gather")} == {"bfloat16"}


@on_ranks(4)
def test_reduce_scatters_overlap_backward_and_all_gathers_follow_the_step(ranks):
    run = runs("dp4", "distopt")
    for step in run["steps"]:
        kinds = [e["op"] for e in step]
        assert kinds == ["reduce_scatter"] * run["buckets"] + ["all_gather"] * run["buckets"]
        assert all(e["phase"] == "backward" for e in ops(step, "reduce_scatter"))
        assert all(e["in_step"] for e in ops(step, "all_gather"))


@on_ranks(4)
def test_overlapped_all_gathers_run_in_the_next_forward(ranks):
    """overlap_param_gather: the step issues only the first bucket the forward needs; every other bucket's
    all-gather is issued by a forward pre-hook, before that step's backward starts reduce-scattering."""
    run = runs("dp4", "distopt/overlap_param_gather")
    later = run["steps"][1]
    first_reduce_scatter = [e["op"] for e in later].index("reduce_scatter")
    in_forward = [e for e in later[:first_reduce_scatter] if e["op"] == "all_gather"]
    assert len(in_forward) == run["buckets"] - 1
    assert all(e["phase"] == "forward" and not e["in_step"] for e in in_forward)
    assert [e["in_step"] for e in ops(later, "all_gather")][-1] is True


@on_ranks(4)
def test_bad_input_is_refused_with_a_message(ranks):
    errors = results()["bad_input"]
    assert "use_distributed_optimizer=True" in errors["distopt_on_plain_ddp"]
    assert "needs use_distributed_optimizer=True" in errors["overlap_param_gather_without_distopt"]
    assert "reduce-scattered" in errors["unsharded_on_sharded_ddp"]


class CudaTypeNames(TorchFunctionMode):
    """A CPU tensor's `.type()` answers with the CUDA name, `.cuda()` leaves it where it is, and `device="cuda"`
    literals land on the CPU: megatron's optimizers pick the fp32-master path by that name
    (distrib_optimizer.py::DistributedOptimizer._build_model_and_main_param_groups) and refuse any other.
    Without Transformer Engine or Apex megatron steps torch.optim.AdamW (weight_decay 0 here, so Adam)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.cuda:
            return args[0]
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


def mlp() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(torch.nn.Linear(H, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, H)).to(torch.bfloat16)


def mlp_batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(B, H, generator=g).to(torch.bfloat16) for _ in range(STEPS)]


def train_mlp(model, module, optimizer, zero_grad) -> dict:
    losses, steps = [], []
    for x in mlp_batches():
        zero_grad()
        with CollectiveRecorder() as rec:
            loss = (model(x.chunk(2)[dist.get_rank()]).float() ** 2).mean()
            loss.backward()
            model.finish_grad_sync()
            optimizer.step()
        steps.append([{"op": e.op, "nbytes": e.nbytes, "dtype": e.dtype, "phase": e.phase} for e in rec.events])
        losses.append(loss.item())
    return {
        "losses": losses,
        "steps": steps,
        "params": [p.detach().float().flatten().tolist() for p in module.parameters()],
    }


def megatron_run(grad_reduce_in_fp32: bool = True) -> dict:
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    with megatron_parallel_state():
        module = mlp()
        with CudaTypeNames():
            config = TransformerConfig(
                num_layers=1, hidden_size=H, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
            )
            model = MegatronDDP(
                config,
                DistributedDataParallelConfig(
                    use_distributed_optimizer=True, grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=True
                ),
                module,
            )
            optimizer = get_megatron_optimizer(
                OptimizerConfig(
                    optimizer="adam", lr=LR, bf16=True, clip_grad=0.0, weight_decay=0.0, use_distributed_optimizer=True
                ),
                [model],
                use_gloo_process_groups=False,
            )
            inner = optimizer.chained_optimizers[0] if hasattr(optimizer, "chained_optimizers") else optimizer

            def zero_grad():
                model.zero_grad_buffer()
                optimizer.zero_grad()

            result = train_mlp(model, module, optimizer, zero_grad)
        buffer = model.buffers[0]
        states = [t for state in inner.optimizer.state.values() for k, t in state.items() if k != "step"]
        masters = [p for group in inner.shard_fp32_from_float16_groups for p in group]
        main_grads = [m.grad for m in masters]  # what the last step stepped on, kept until the next zero_grad
        in_buffer = buffer.grad_data.untyped_storage().data_ptr()
        result.update(
            optimizer_class=type(inner).__name__,
            inner_class=type(inner.optimizer).__name__,
            numel_unpadded=sum(p.numel() for p in module.parameters()),
            grad_buffer={"numel": buffer.grad_data.numel(), "dtype": str(buffer.grad_data.dtype)},
            param_buffer={"numel": buffer.param_data.numel(), "dtype": str(buffer.param_data.dtype)},
            master_bytes=sum(m.numel() * m.element_size() for m in masters),
            state_bytes=sum(t.numel() * t.element_size() for t in states),
            main_grad_dtypes=sorted({str(g.dtype) for g in main_grads}),
            main_grad_bytes=sum(g.numel() * g.element_size() for g in main_grads),
            main_grads_in_buffer=[g.untyped_storage().data_ptr() == in_buffer for g in main_grads],
        )
    return result


def reference_run() -> dict:
    module = mlp()
    model = DistributedDataParallel(
        module, dist.group.WORLD, bucket_size=None, grad_dtype=torch.float32, use_distributed_optimizer=True
    )
    optimizer = DistributedOptimizer(model, lambda tensors: torch.optim.AdamW(tensors, lr=LR, weight_decay=0.0))
    result = train_mlp(model, module, optimizer, model.zero_grad)
    result["bytes"] = bytes_per_rank(model, optimizer)
    return result


def megatron_tied_embeddings() -> dict:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel as MegatronDDP
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    with megatron_parallel_state(pipeline_model_parallel_size=2):
        torch.manual_seed(SEED)
        with CudaTypeNames():
            config = TransformerConfig(
                num_layers=2,
                hidden_size=H,
                num_attention_heads=2,
                use_cpu_initialization=True,
                pipeline_dtype=torch.float32,
                pipeline_model_parallel_size=2,
            )
            gpt = GPTModel(
                config,
                get_gpt_layer_local_spec(),
                vocab_size=64,
                max_sequence_length=8,
                pre_process=parallel_state.is_pipeline_first_stage(),
                post_process=parallel_state.is_pipeline_last_stage(),
                share_embeddings_and_output_weights=True,
            )
            weight = gpt.shared_embedding_or_output_weight()
            ends = [torch.empty_like(weight) for _ in range(2)]
            dist.all_gather(ends, weight.detach())
            model = MegatronDDP(config, DistributedDataParallelConfig(), gpt)
            model.zero_grad_buffer()
            weight.main_grad.fill_(dist.get_rank() + 1.0)
            with CollectiveRecorder() as rec:
                finalize_model_grads([model])
        group = parallel_state.get_embedding_group()
        result = {
            "first": parallel_state.is_pipeline_first_stage(),
            "embedding_group": dist.get_process_group_ranks(group),
            "ends_equal_after_construction": torch.equal(ends[0], ends[1]),
            "main_grad_after_finalize": sorted(set(weight.main_grad.flatten().tolist())),
            "weight_bytes": weight.numel() * weight.element_size(),
            "embedding_group_all_reduces": [
                e.nbytes
                for e in rec.events
                if e.op == "all_reduce" and list(e.group_ranks) == dist.get_process_group_ranks(group)
            ],
        }
    return result


@functools.cache
def megatron_results() -> dict:
    """This rank's view of both DP 2 runs and the PP 2 tied embeddings (CPU; computed once a rank)."""
    cuda_calls_on_cpu()
    return {
        "megatron": megatron_run(),
        "megatron_bf16_grads": megatron_run(grad_reduce_in_fp32=False),
        "reference": reference_run(),
        "tied": megatron_tied_embeddings(),
    }


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")
def test_megatron_distributed_optimizer_and_the_reference_train_bit_for_bit(ranks):
    """megatron-core's DistributedOptimizer (get_megatron_optimizer, bf16, torch AdamW without TE/Apex) and the
    reference, same MLP, seed and data at DP 2: equal losses and bf16 parameters after three steps, although
    megatron pads its buffer differently and slices its masters at parameter boundaries."""
    result = megatron_results()
    megatron, reference = result["megatron"], result["reference"]
    assert (megatron["optimizer_class"], megatron["inner_class"]) == ("DistributedOptimizer", "AdamW")
    assert megatron["losses"] == reference["losses"]
    assert megatron["params"] == reference["params"]


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")
def test_megatron_holds_fp32_main_grads_and_a_twelve_byte_optimizer_share(ranks):
    """Megatron's accounting with grad_reduce_in_fp32: bf16 parameter buffer (2 bytes) + fp32 gradient buffer
    (4 bytes) per padded element on every rank, and 4 + 4 + 4 bytes of master and Adam moments per *model*
    element of this rank's slice: its masters skip the padding, the reference's flat slices keep it."""
    results = every_rank(megatron_results())
    for result in results:
        megatron = result["megatron"]
        padded = megatron["grad_buffer"]["numel"]
        assert megatron["grad_buffer"]["dtype"] == "torch.float32" and megatron["param_buffer"] == {
            "numel": padded,
            "dtype": "torch.bfloat16",
        }
        assert padded % 128 == 0 and padded > megatron["numel_unpadded"]  # lcm(dp, 128), params 64-aligned
        assert megatron["state_bytes"] == 2 * megatron["master_bytes"]
    assert sum(r["megatron"]["master_bytes"] for r in results) == 4 * results[0]["megatron"]["numel_unpadded"]
    for result in results:  # the reference pads the one bucket only to a multiple of dp
        numel = result["megatron"]["numel_unpadded"]
        padded = numel + numel % 2
        assert result["reference"]["bytes"] == {
            "parameters": 2 * padded,
            "gradients": 4 * padded,
            "master_weights": 2 * padded,
            "optimizer_states": 4 * padded,
        }


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")
def test_megatron_with_bf16_grads_steps_on_an_fp32_copy_of_its_gradient_shard(ranks):
    """grad_reduce_in_fp32=False (megatron-core's default): the gradient buffer is bf16 (2 bytes per element on
    every rank), but the step casts this rank's slice to a new fp32 tensor per master (4 bytes per element of the
    slice), so the distributed optimizer holds 2 + 2 + (4 + 4 + 8)/d bytes per parameter, its doc's 4 + 16/d.
    With fp32 gradients the masters step on views of the fp32 buffer: 2 + 4 + 12/d, no copy."""
    results = every_rank(megatron_results())
    for result in results:
        bf16, fp32 = result["megatron_bf16_grads"], result["megatron"]
        assert bf16["grad_buffer"]["dtype"] == "torch.bfloat16" and bf16["main_grad_dtypes"] == ["torch.float32"]
        assert not any(bf16["main_grads_in_buffer"]) and bf16["main_grad_bytes"] == bf16["master_bytes"]
        assert bf16["state_bytes"] == 2 * bf16["master_bytes"]
        assert fp32["main_grad_dtypes"] == ["torch.float32"] and all(fp32["main_grads_in_buffer"])
    numel = results[0]["megatron_bf16_grads"]["numel_unpadded"]
    assert sum(r["megatron_bf16_grads"]["main_grad_bytes"] for r in results) == 4 * numel


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")
def test_megatron_reduce_scatters_fp32_and_all_gathers_bf16_like_the_reference(ranks):
    """Per step one fp32 reduce-scatter of the gradient buffer and one bf16 all-gather of the parameter buffer
    after the step; megatron adds one fp32 scalar all-reduce, the gradient norm ChainedOptimizer.step computes
    for logging. The reduce-scatter runs in backward (overlap_grad_reduce) from the second step on: in the
    first, megatron's DDP records which gradients fill its bucket and issues it in finish_grad_sync."""
    result = megatron_results()
    megatron, reference = result["megatron"], result["reference"]
    padded = megatron["grad_buffer"]["numel"]
    for step, (theirs, ours) in enumerate(zip(megatron["steps"], reference["steps"])):
        assert [(e["op"], e["dtype"]) for e in theirs] == [
            ("reduce_scatter", "float32"),
            ("all_reduce", "float32"),
            ("all_gather", "bfloat16"),
        ]
        assert [e["nbytes"] for e in theirs] == [4 * padded, 4, 2 * padded]
        assert [(e["op"], e["dtype"], e["phase"]) for e in ours] == [
            ("reduce_scatter", "float32", "backward"),
            ("all_gather", "bfloat16", "forward"),
        ]
        assert theirs[0]["phase"] == ("forward" if step == 0 else "backward")


@on_ranks(2)
@pytest.mark.upstream("megatron-lm")
def test_megatron_ties_the_embedding_across_stages_as_the_reference_does(ranks):
    """megatron-core's GPTModel at PP 2 with share_embeddings_and_output_weights (its default): the embedding
    group is the pipeline's first and last rank, the last stage's copy equals the first stage's embedding
    after construction (zeroed, then all-reduced), and finalize_model_grads sums the two copies' main_grad
    (1 + 2 on both ends) in one all-reduce of the whole matrix over that group: what
    reference.pipeline.tied_embeddings does (tests/reference/test_tied_embeddings.py)."""
    results = [r["tied"] for r in every_rank(megatron_results())]
    assert [r["first"] for r in results] == [True, False]
    for tied in results:
        assert tied["embedding_group"] == [0, 1] and tied["ends_equal_after_construction"]
        assert tied["main_grad_after_finalize"] == [3.0]
        assert tied["embedding_group_all_reduces"] == [tied["weight_bytes"]] == [64 * 16 * 4]
