"""Scale by simulation: one process traces one rank of a TP x PP x DP job of thousands of ranks (torch's fake
process group, meta-device weights) and checks each group's bytes against closed forms. Read in this order:

  shapes.py     the model presets (70B-shaped) and the setup, validated once
  formulas.py   closed-form count and bytes per group (tp/pp/dp) and collective type, for a pipeline stage
  stage.py      one pipeline stage built from reference.tensor_parallel (embedding / blocks / head + loss)
  schedule.py   a GPipe step with point-to-point send/recv between stages
  grads.py      the gradient finish: SP grads over TP, then DDP all-reduce or distributed-optimizer RS + AG
  simulate.py   the fake world, the trace of one step, the per-group summary next to the formulas
  __main__.py   `python -m reference.scale --tp 8 --pp 8 --dp 64 --model 70b`
"""
