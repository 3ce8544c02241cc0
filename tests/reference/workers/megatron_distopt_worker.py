"""Worker for test_distributed_optimizer.py's upstream tests: `torchrun --nproc-per-node 2 megatron_distopt_worker.py
OUT` (or in a shared launch, workers/shared_worker.py).

Trains one bf16 MLP (16 -> 61 -> 16, odd sizes) for three Adam steps at DP 2 twice from the same seed and data:
with megatron-core 0.16.1's own DistributedDataParallel (use_distributed_optimizer, grad_reduce_in_fp32) and
DistributedOptimizer (get_megatron_optimizer, bf16), and with the reference's (reference.data_parallel), under a
CollectiveRecorder. Each rank writes OUT/rank{r}.json: both runs' final parameters, losses, collectives per
step and megatron's buffer and optimizer-state sizes. Then, at PP 2, megatron's tied embeddings
(`megatron_tied_embeddings`): a GPTModel with share_embeddings_and_output_weights on each stage, its embedding
group, the last stage's copy after construction, and what finalize_model_grads does to the tied matrix's
main_grad (set to rank + 1 on each end: no forward is needed for the mechanism, and megatron's attention
dropout forks the CUDA RNG, which the CPU has not).

Runs on CPU because megatron's allocations on torch.cuda.current_device() are redirected to the CPU
(reference.torch_patches.cuda_calls_on_cpu) and `CudaTypeNames` below makes a CPU tensor's `.type()` read
'torch.cuda.BFloat16Tensor': megatron's optimizers pick the fp32-master path by that string
(distrib_optimizer.py::DistributedOptimizer._build_model_and_main_param_groups) and refuse any other.
Without Transformer Engine or Apex megatron steps torch.optim.AdamW (weight_decay 0 here, so Adam).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from common import serve
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.transformer import TransformerConfig
from megatron_state import megatron_parallel_state
from torch.overrides import TorchFunctionMode

from reference.data_parallel import DistributedDataParallel as ReferenceDDP
from reference.data_parallel.distributed_optimizer import DistributedOptimizer, bytes_per_rank
from reference.measure.recorder import CollectiveRecorder
from reference.torch_patches import cuda_calls_on_cpu

H, FFN, B, STEPS, SEED, LR = 16, 61, 8, 3, 1234, 1e-3


class CudaTypeNames(TorchFunctionMode):
    """A CPU tensor's `.type()` answers with the CUDA name, `.cuda()` leaves it where it is, and `device="cuda"`
    literals land on the CPU."""

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


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(B, H, generator=g).to(torch.bfloat16) for _ in range(STEPS)]


def train(model, module, optimizer, zero_grad) -> dict:
    losses, steps = [], []
    for x in batches():
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


def megatron_run() -> dict:
    with megatron_parallel_state():
        module = mlp()
        with CudaTypeNames():
            config = TransformerConfig(
                num_layers=1, hidden_size=H, num_attention_heads=1, bf16=True, params_dtype=torch.bfloat16
            )
            model = DistributedDataParallel(
                config,
                DistributedDataParallelConfig(
                    use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=True
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

            result = train(model, module, optimizer, zero_grad)
        buffer = model.buffers[0]
        states = [t for state in inner.optimizer.state.values() for k, t in state.items() if k != "step"]
        masters = [p for group in inner.shard_fp32_from_float16_groups for p in group]
        result.update(
            optimizer_class=type(inner).__name__,
            inner_class=type(inner.optimizer).__name__,
            numel_unpadded=sum(p.numel() for p in module.parameters()),
            grad_buffer={"numel": buffer.grad_data.numel(), "dtype": str(buffer.grad_data.dtype)},
            param_buffer={"numel": buffer.param_data.numel(), "dtype": str(buffer.param_data.dtype)},
            master_bytes=sum(m.numel() * m.element_size() for m in masters),
            state_bytes=sum(t.numel() * t.element_size() for t in states),
        )
    return result


def reference_run() -> dict:
    module = mlp()
    model = ReferenceDDP(
        module, dist.group.WORLD, bucket_size=None, grad_dtype=torch.float32, use_distributed_optimizer=True
    )
    optimizer = DistributedOptimizer(model, lambda tensors: torch.optim.AdamW(tensors, lr=LR, weight_decay=0.0))
    result = train(model, module, optimizer, model.zero_grad)
    result["bytes"] = bytes_per_rank(model, optimizer)
    return result


def megatron_tied_embeddings() -> dict:
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
            model = DistributedDataParallel(config, DistributedDataParallelConfig(), gpt)
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


def results(_device: torch.device) -> dict:
    """Both DP 2 runs and the PP 2 tied embeddings (CPU)."""
    assert dist.get_world_size() == 2, "run on 2 ranks"
    cuda_calls_on_cpu()
    return {"megatron": megatron_run(), "reference": reference_run(), "tied": megatron_tied_embeddings()}


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()
