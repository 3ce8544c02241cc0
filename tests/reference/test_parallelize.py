"""reference.parallelize: the one entry applies TP (with the vocabulary split), recompute and the DP form in that
order to the plain GPT, and the result trains like the GPT it came from; a DP form it does not know is one line.
At world 1 on gloo (one process): the demo's tests run every layout under torchrun."""

from __future__ import annotations

import pytest
import torch

from reference.data_parallel import DistributedDataParallel
from reference.fsdp import FullyShardedDataParallel
from reference.gpt.model import GPT, GPTConfig
from reference.parallel_state import ParallelConfigError, build_layout
from reference.parallelize import ParallelizeConfig, build_optimizer, parallelize
from reference.tensor_parallel.layers import ColumnParallelLinear
from reference.tensor_parallel.vocab_parallel import LMHead

CONFIG = GPTConfig(vocab_size=32, hidden_size=16, num_attention_heads=2, num_layers=2, seq_length=8)


def test_an_unknown_dp_form_or_recompute_mode_is_refused_in_one_line():
    choices = "replicate, optimizer, gradients, fsdp, fsdp2"
    with pytest.raises(ParallelConfigError, match=rf"^unknown DP form 'zero9'; choose one of {choices}$"):
        ParallelizeConfig(dp_sharding="zero9")
    with pytest.raises(ParallelConfigError, match="unknown recompute mode 'partial'"):
        ParallelizeConfig(recompute="partial")


# ("fsdp", "full"): a full recomputation re-runs a block in backward, after FSDP1 resharded it after forward
@pytest.mark.parametrize("dp_sharding, recompute", [("replicate", "full"), ("fsdp", "selective"), ("fsdp", "full")])
def test_parallelize_splits_recomputes_and_wraps_and_trains_like_the_plain_gpt(one_rank_gloo, dp_sharding, recompute):
    layout = build_layout(1)
    config = ParallelizeConfig(recompute=recompute, dp_sharding=dp_sharding)
    seen = []
    model = parallelize(GPT(CONFIG, seed=3), layout, config, observe=seen.extend)
    stage = model.module
    assert isinstance(model, DistributedDataParallel if dp_sharding == "replicate" else FullyShardedDataParallel)
    assert seen == [stage]  # observed once split, before the DP wrapper
    assert isinstance(stage.layers[0].attention.qkv, ColumnParallelLinear)
    assert isinstance(stage.output_layer, LMHead) and stage.output_layer.tp_group is layout.tp_group
    assert [block.recompute for block in stage.layers] == [recompute, recompute]
    assert [block.attention.recompute for block in stage.layers] == [recompute == "selective"] * 2
    plain = GPT(CONFIG, seed=3)
    optimizers = [
        build_optimizer(model, config, lambda p: torch.optim.SGD(p, lr=0.1)),
        torch.optim.SGD(plain.parameters(), lr=0.1),
    ]
    tokens = torch.randint(CONFIG.vocab_size, (2, CONFIG.seq_length + 1), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        losses = []
        for net, optimizer in zip((model, plain), optimizers):
            loss = net(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            if net is model and dp_sharding == "replicate":
                model.finish_grad_sync()
            optimizer.step()
            net.zero_grad()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-6, abs=1e-6)
