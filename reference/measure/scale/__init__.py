"""Scale by simulation: one process traces one rank of a TP x PP x DP job of thousands (torch's fake
process group, meta-device weights) running the reference's own training step, and checks each group's bytes
against closed forms:

  shapes.py     the model presets (Llama 3 70B and 405B, the GPT block at 70B's sizes) and the setup, validated
  formulas.py   closed-form count and bytes per group (tp/pp/dp) and collective type, for a pipeline stage
  simulate.py   the fake world: one rank's stage on the meta device, one reference.gpt.train.train_step under the
                recorder; the per-group summary next to the formulas
  __main__.py   `python -m reference.measure.scale --tp 8 --pp 8 --dp 64 --model llama3-70b`
  grid.py       the closed forms over every layout the Scale page's calculator offers, as JSON
  moe_*.py      the same for a MoE model's MoE layers with expert parallelism (`--ep`), at the routing
                skew routing.py states
"""
