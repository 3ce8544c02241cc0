"""Pipeline parallelism, one mechanism per file. Read in this order:

p2p.py        send/recv of activations and their gradients between adjacent stages (and round a ring)
steps.py      one forward or backward step, timed and counted, and the data-parallel sync switch
schedules.py  GPipe and 1F1B: the order of forwards and backwards, measured bubble and in-flight peak
interleaved.py  interleaved 1F1B over v model chunks per stage (Megatron's table and warm-up)
in_flight.py  how many micro-batches' activations autograd really keeps alive
tied_embeddings.py  one matrix for the first stage's embedding and the last stage's logits: the embedding
              group, the initial copy, the gradient sum
replay.py     the idle fraction of recorded action orders under uniform costs (bubble against its formula)
"""
