"""A small decoder (GPT-2 or Llama/Qwen2 style), its pipeline stages and its TP x PP x DP training step.
Read in this order:

  model.py  GPTConfig (style "gpt2" | "llama"); GPT in plain PyTorch, whole (the oracle, also the model the
            FSDP runs shard: reference/fsdp/units.py) or one stage's layers; split_layers; gpt_blocks, a
            middle stage (blocks only) that block-level tests feed hidden states
  parallelize.py  parallelize_gpt splits a GPT over TP; build_stage / build_chunks: this rank's stage or chunks
  hf_weights.py  a Hugging Face Qwen2ForCausalLM's weights onto the "llama" style (the oracle's mapping)
  train.py  one optimizer step: DP rows, micro-batches through the pipeline, gradient finalization, SGD;
            the stage replicated over DP (data_parallel) or sharded by FSDP x TP (fully_sharded)
  arguments.py  the demo's flags and their one-line checks
  demo.py   `torchrun --nproc-per-node 8 -m reference --tp 2 --pp 2 --dp 2` (--dp-sharding fsdp: 2D;
            --model llama: the Llama/Qwen2 block): parse, layout, model, reference.parallelize, train, report
"""
