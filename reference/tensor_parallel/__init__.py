"""Megatron-style tensor parallelism, one mechanism per file. Read in this order:

  collectives.py    the five collectives on the first (sequence) or last (feature) dimension
  mappings.py       the communication regions f, g, scatter/gather, and the sequence-parallel pair
  linear_kernel.py  matmul whose backward overlaps the dX collective with the dW GEMM (+ main_grad)
  layers.py         ColumnParallelLinear / RowParallelLinear, Megatron's arguments and (output, bias)
  transformer.py    the blocks in plain PyTorch, GPT-2 and Llama/Qwen2 style: the unsharded oracle
  parallelize.py    parallelize(model, layout): swaps their linears for the parallel layers, wires SP,
                    the dropout stream and recomputation
  rotary.py         rotary position embeddings (half rotation, as HF Qwen2)
  random.py         the per-TP-rank random stream for dropout on split activations
  cross_entropy.py  loss parallelism: cross-entropy of vocabulary-split logits (max / sum all-reduces)
  vocab_parallel.py vocabulary-split embedding and LM head + loss (padding V to a multiple of TP)

Process groups come from reference.parallel_state; reference.recorder records what goes over the wire.
"""
