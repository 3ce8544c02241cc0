"""Count what megatron-core 0.16.1's own TransformerLayer (the local GPT spec: torch LayerNorm, its
Column/RowParallelLinear, the unfused DotProductAttention; no Transformer Engine) saves for backward, with the
same saved-tensor counter as the reference, without and with tensor parallelism (t = 2).

Usage: `torchrun --nproc-per-node 2 megatron_activation_worker.py OUT_DIR` (CPU/gloo; or in a shared launch,
workers/shared_worker.py); writes OUT_DIR/rank<r>.json.
Runs on the CPU with three substitutions, none of which changes what is saved: torch.cuda.current_device()
answers "cpu" (reference.torch_patches.cuda_calls_on_cpu), the causal mask is passed in (megatron would build
its default one on "cuda"), and the CUDA RNG tracker's fork, which swaps CUDA generator states around
attention dropout, is a no-op (a CPU-only torch has no CUDA generator; the masks' values are not counted).
Sequence parallelism is not run: without Apex or Transformer Engine the local spec's LayerNorm is torch's,
which refuses it (megatron-lm:megatron/core/transformer/torch_norm.py::WrappedTorchNorm.__new__). Selective and
full recomputation are not run: megatron's CheckpointFunction saves all CUDA generator states
before it runs the region (megatron-lm:megatron/core/tensor_parallel/random.py::CheckpointFunction.forward).
"""

import contextlib
import dataclasses
import warnings

import torch
from common import serve

from reference.measure.activation_memory.counting import SavedTensorCounter
from reference.torch_patches import cuda_calls_on_cpu

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")
S, B, H, A = 32, 2, 64, 4  # the reference worker's COUNT_SHAPE


class CpuRNGTracker:
    """Stands in for megatron's CudaRNGStatesTracker: dropout draws from the default CPU generator."""

    def fork(self, name: str = "model-parallel-rng"):
        return contextlib.nullcontext()


def count_layer(tp: int) -> dict:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron_state import megatron_parallel_state

    with megatron_parallel_state(tensor_model_parallel_size=tp):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=H,
            num_attention_heads=A,
            hidden_dropout=0.1,
            attention_dropout=0.1,
            params_dtype=torch.bfloat16,
            bf16=True,
            tensor_model_parallel_size=tp,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            bias_activation_fusion=False,
            apply_rope_fusion=False,
            persist_layer_norm=False,
        )
        layer = TransformerLayer(config, get_gpt_layer_local_spec().submodules, layer_number=1)
        layer.train()
        x = torch.randn(S, B, H, dtype=torch.bfloat16, requires_grad=True)
        causal = torch.triu(torch.ones(1, 1, S, S, dtype=torch.bool), diagonal=1)  # True: masked out
        with SavedTensorCounter(layer) as counter:
            layer(x, attention_mask=causal)
        return {
            "tp": tp,
            "counted_bytes": counter.total_bytes,
            "saved": [dataclasses.asdict(s) for s in counter.saved],
            "attention_softmax_in_fp32": config.attention_softmax_in_fp32,
        }


def results(_device: torch.device) -> dict:
    """{configuration: counts} of one TransformerLayer, with megatron's RNG tracker replaced by CpuRNGTracker
    for the count only (the workers sharing the launch get megatron's back)."""
    cuda_calls_on_cpu()
    from megatron.core.tensor_parallel import random as megatron_random

    saved = megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED
    megatron_random._CUDA_RNG_STATE_TRACKER = CpuRNGTracker()
    megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    try:
        return {"no parallelism": count_layer(1), "tensor parallel": count_layer(2)}
    finally:
        megatron_random._CUDA_RNG_STATE_TRACKER, megatron_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved


def main() -> None:
    serve(results)


if __name__ == "__main__":
    main()
