"""A mixture-of-experts layer with expert parallelism, one mechanism per file. Read in this order:

  router.py       top-k routing (top-k of the logits, softmax over the k) and the load-balancing loss
  capacity.py     the capacity-factor mode: drop what an expert cannot take
  permute.py      permute / unpermute: each expert's tokens made contiguous, and put back
  mappings.py     the communication regions: the all-to-all, and the uneven gather / reduce-scatter over TP
  dispatcher.py   the all-to-all dispatcher: token counts first, then the tokens, and back
  experts.py      the experts, one MLP each (megatron's SequentialMLP)
  combine.py      the expert outputs weighted by the router's probabilities, summed per token
  layer.py        MoELayer: route, dispatch, experts, combine; the unsharded layer as written
  parallelize.py  parallelize_moe(layer, ep_group, tp_group): experts split over EP, each over TP

Mirrors megatron-core's megatron/core/transformer/moe/ (notes/reference/moe.layer.md maps each file).
"""
