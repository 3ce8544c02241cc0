"""Scale by simulation: one process traces one rank of a TP x PP x DP job of thousands of ranks (torch's fake
process group, meta-device weights) running the reference's own training step, and checks each group's bytes
against closed forms. Read in this order:

  shapes.py     the model presets (70B-shaped) and the setup, validated once
  formulas.py   closed-form count and bytes per group (tp/pp/dp) and collective type, for a pipeline stage
  simulate.py   the fake world; one rank's stage (reference.gpt.parallelize.build_stage on the meta device), its
                DDP wrapper and one reference.gpt.train.train_step under the recorder; the per-group summary
                next to the formulas
  __main__.py   `python -m reference.measure.scale --tp 8 --pp 8 --dp 64 --model 70b`
  grid.py       the closed forms over every layout the Scale page's calculator offers, as JSON
"""
