"""PyTorch DTensor's tensor-parallel plan on Hugging Face's own Qwen2ForCausalLM: the other side of the
reference's `parallelize(model, layout)`, run as a demo. Read in this order:

  plan.py      the Tensor Parallelism Knowledge Compilation's plans (ColwiseParallel, RowwiseParallel,
               SequenceParallel, loss_parallel) on a tiny Qwen2, and HF's own plan; the tests import them here
  __main__.py  `torchrun --nproc-per-node 2 -m reference.hf_tp`: one forward and backward under the plan,
               printing each parameter's placement, the collectives CommDebugMode counted, and the loss beside
               the unsharded model's

Needs transformers (`make setup` installs it with the test extras); nothing here imports it until used.
"""
