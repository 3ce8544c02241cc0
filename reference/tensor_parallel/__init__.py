"""Megatron-style tensor parallelism, one mechanism per file. Read in this order:

  collectives.py    the collectives on the sequence or feature dimension
  mappings.py       the communication regions f, g, scatter/gather and the sequence-parallel pair
  linear_kernel.py  the matmul whose backward overlaps the dX collective with the dW GEMM
  deferred_wgrad.py its dW and db left for later: the backward in two of the zero-bubble pipelines
  layers.py         ColumnParallelLinear / RowParallelLinear
  transformer.py    the GPT-2 and Llama/Qwen2 blocks in plain PyTorch: the unsharded oracle
  parallelize.py    parallelize(model, layout): swaps their linears for the parallel layers
  rotary.py         rotary position embeddings (as HF Qwen2)
  random.py         the per-TP-rank random stream for dropout
  cross_entropy.py  loss parallelism over vocabulary-split logits
  vocab_parallel.py the vocabulary-split embedding, and the LM head (unsharded or split)

Process groups come from reference.parallel_state.
"""
