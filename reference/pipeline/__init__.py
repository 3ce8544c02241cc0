"""Pipeline parallelism, one mechanism per file. Read in this order:

p2p.py        send/recv of activations and their gradients between adjacent stages (and round a ring)
steps.py      one forward or backward step, and the data-parallel sync switch
schedules.py  GPipe and 1F1B: the order of forwards and backwards, with an optional observer
interleaved.py  interleaved 1F1B over v model chunks per stage (Megatron's table and warm-up)
zero_bubble.py  ZB-H1, ZB-V and DualPipeV as action lists per rank (F, I, W, B, F;B), as torch orders them
zero_bubble_run.py  one rank's action list run, the backward in two (reference.tensor_parallel.deferred_wgrad)
tied_embeddings.py  one matrix for the first stage's embedding and the last stage's logits: the embedding
              group, the initial copy, the gradient sum
Nothing here measures: timing, FLOPs and the in-flight meter attach as an observer (reference.measure).
"""
