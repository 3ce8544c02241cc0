"""A small decoder (GPT-2 or Llama/Qwen2 style) split into pipeline stages, and its TP x PP x DP training
step. Read in this order:

  model.py  GPTConfig (style "gpt2" | "llama"), the unsharded model (also the one the FSDP runs shard, a
            unit per layer: reference/fsdp/units.py), GPTStage (embedding / blocks / head of one stage),
            split_layers
  hf_weights.py  a Hugging Face Qwen2ForCausalLM's weights onto the "llama" style (the oracle's mapping)
  train.py  one optimizer step: DP rows, micro-batches through the pipeline, gradient finalization, SGD;
            the stage replicated over DP (data_parallel) or sharded by FSDP x TP (fully_sharded)
  demo.py   `torchrun --nproc-per-node 8 -m reference --tp 2 --pp 2 --dp 2` (--dp-sharding fsdp: 2D;
            --model llama: the Llama/Qwen2 block)
"""
