"""reference against megatron-core 0.16.1, at TP = world (2 and 4 ranks, and 2 GPUs):

* the PP x DP x TP process groups equal those of megatron's initialize_model_parallel, for every split;
* ColumnParallelLinear / RowParallelLinear: same seed, same shards, same outputs and gradients (asserted per
  tensor on every rank), and the identical recorded collective sequence (op, group, shape, bytes, dtype,
  phase, async), over bias / skip_bias_add / gather_output / input_is_parallel / sequence_parallel.

megatron-core runs with use_cpu_initialization=True; on CPU the buffers its gather_output and
sequence-parallel paths allocate on torch.cuda.current_device() are redirected to the CPU.
"""

import functools
import itertools

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.tensor_parallel import layers as megatron_layers

from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import cuda_calls_on_cpu
from reference.parallel_state import build_layout
from reference.tensor_parallel import layers as reference_layers
from reference.tensor_parallel.transformer import init_method_normal
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import assert_close, gather_dim, groups_of_the_block, megatron_parallel_state

# (bias, skip_bias_add) pairs x gather_output / input_is_parallel x sequence_parallel, as layers() loops:
COLUMN_CASES, ROW_CASES = 3 * 2 * 2, 3 * 2 * 2 - 3  # a row layer's sequence parallelism needs a parallel input

IN, OUT, B = 8, 16, 2


def layouts(device) -> list[dict]:
    """The process-group grid: the same groups as megatron's initialize_model_parallel, for every TP x PP split
    and both rank orders megatron supports; per layout, both sides' groups of this rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    splits = [(t, p) for t in (1, 2, 4) for p in (1, 2, 4) if t * p <= world and (t, p) != (1, 1)]
    found = []
    for (tp_size, pp_size), order in [(split, order) for split in splits for order in ("tp-pp-dp", "tp-dp-pp")]:
        with groups_of_the_block():  # each layout's groups, ours and megatron's, go with it
            grid = build_layout(tp_size, pp_size, order=order)
            with megatron_parallel_state(
                tensor_model_parallel_size=tp_size,
                pipeline_model_parallel_size=pp_size,
                order=order.replace("tp-", "tp-cp-ep-"),
            ):
                groups = {
                    name: [dist.get_process_group_ranks(ours), dist.get_process_group_ranks(theirs)]
                    for name, ours, theirs in [
                        ("tp", grid.tp_group, mpu.get_tensor_model_parallel_group()),
                        ("dp", grid.dp_group, mpu.get_data_parallel_group()),
                        ("pp", grid.pp_group, mpu.get_pipeline_model_parallel_group()),
                    ]
                }
                total = torch.tensor([float(rank)], device=device)
                dist.all_reduce(total, group=grid.tp_group)  # the TP group really is the run of consecutive ranks
                found.append(
                    {
                        "order": order,
                        "tp": tp_size,
                        "pp": pp_size,
                        "groups": groups,
                        "describe": grid.describe(),
                        "ranks": [
                            [grid.tp_rank, grid.dp_rank],
                            [mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank()],
                        ],
                        "tp_rank_sum": total.item(),
                    }
                )
    return found


def build(kind, lib, seed, tp, device, **kw):
    world = dist.get_world_size()
    torch.manual_seed(seed)
    init_method = init_method_normal(0.02)
    if lib == "megatron":
        config = ModelParallelConfig(
            tensor_model_parallel_size=world,
            sequence_parallel=kw.pop("sequence_parallel"),
            use_cpu_initialization=True,
            params_dtype=torch.float32,
        )
        layer = getattr(megatron_layers, kind)(
            IN, OUT, config=config, init_method=init_method, tp_group=mpu.get_tensor_model_parallel_group(), **kw
        )
    else:
        layer = getattr(reference_layers, kind)(IN, OUT, tp_group=tp, init_method=init_method, device=device, **kw)
    if layer.bias is not None:  # both zero-initialize; give the bias values so its handling shows
        with torch.no_grad():
            full = torch.randn(OUT, generator=torch.Generator().manual_seed(seed + 1))
            layer.bias.copy_(full.chunk(world)[dist.get_rank()] if kind == "ColumnParallelLinear" else full)
    return layer.to(device)


def run_layer(layer, x):
    device = x.device
    x = x.clone().requires_grad_()
    with CollectiveRecorder() as rec:
        out, out_bias = layer(x)
        loss = (out * torch.arange(out.numel(), device=device).view_as(out).sin()).sum()
        if out_bias is not None:  # returned, not added (with gather_output it is still this rank's shard)
            loss = loss + (out_bias * out_bias).sum()
        loss.backward()
    grads = {n: p.grad for n, p in layer.named_parameters()}
    return out, out_bias, x.grad, grads, [(e.key(), e.phase, e.async_op) for e in rec.events]


def compare(kind, seed, input_shape, tp, device, **kw) -> dict:
    """Both layers from the same seed on the same input: equal outputs and gradients (asserted here, per
    tensor), and both recorded collective sequences."""
    world = dist.get_world_size()
    what = f"{kind} {kw}"
    x = torch.randn(*input_shape, generator=torch.Generator().manual_seed(seed + 2)).to(device)
    if kw.get("sequence_parallel"):
        x = x.chunk(world, dim=0)[dist.get_rank()]
    mine = run_layer(build(kind, "reference", seed, tp, device, **kw), x)
    theirs = run_layer(build(kind, "megatron", seed, tp, device, **kw), x)
    for name, a, b in zip(["output", "output_bias", "input grad"], mine[:3], theirs[:3]):
        assert (a is None) == (b is None), f"{what}: {name} is {a} vs megatron {b}"
        if a is not None:
            assert_close(a, b, f"{what}: {name}", atol=1e-6, rtol=1e-5)
    assert mine[3].keys() == theirs[3].keys(), (mine[3].keys(), theirs[3].keys())
    for name in mine[3]:
        assert_close(mine[3][name], theirs[3][name], f"{what}: grad {name}", atol=1e-6, rtol=1e-5)
    return {"what": what, "reference": mine[4], "megatron": theirs[4]}


def layers(tp, device) -> list[dict]:
    """ColumnParallelLinear and RowParallelLinear over their options, at TP = world."""
    world, s = dist.get_world_size(), 4 * dist.get_world_size()
    compared = []
    for bias, skip_bias_add, gather_output, sp in itertools.product(
        [True, False], [False, True], [False, True], [False, True]
    ):
        if skip_bias_add and not bias:
            continue
        compared.append(
            compare(
                "ColumnParallelLinear",
                10,
                (s, B, IN),
                tp,
                device,
                bias=bias,
                skip_bias_add=skip_bias_add,
                gather_output=gather_output,
                sequence_parallel=sp,
            )
        )
    for bias, skip_bias_add, input_is_parallel, sp in itertools.product(
        [True, False], [False, True], [True, False], [False, True]
    ):
        if (skip_bias_add and not bias) or (sp and not input_is_parallel):
            continue
        shape = (s, B, IN // world) if input_is_parallel else (s, B, IN)
        compared.append(
            compare(
                "RowParallelLinear",
                20,
                shape,
                tp,
                device,
                bias=bias,
                skip_bias_add=skip_bias_add,
                input_is_parallel=input_is_parallel,
                sequence_parallel=sp,
            )
        )
    return compared


def shards_equal_megatron_master(tp, device) -> bool:
    """Same seed, same shards: the reference's shards re-assemble to megatron's master weight."""
    torch.manual_seed(5)
    master = megatron_layers.ColumnParallelLinear(
        IN,
        OUT,
        config=ModelParallelConfig(tensor_model_parallel_size=dist.get_world_size(), use_cpu_initialization=True),
        init_method=init_method_normal(0.02),
        keep_master_weight_for_test=True,
        tp_group=mpu.get_tensor_model_parallel_group(),
    ).master_weight
    ours = build("ColumnParallelLinear", "reference", 5, tp, device, bias=False)
    return torch.equal(gather_dim(ours.weight.detach().cpu(), 0, tp), master)


@functools.cache
def results(device: torch.device) -> dict:
    """The layouts, then the layers at TP = world: computed once a rank (every comparison asserted on the way)."""
    if device.type == "cpu":
        cuda_calls_on_cpu()
    world = dist.get_world_size()
    found = {"rank": dist.get_rank(), "layouts": layouts(device)}
    with megatron_parallel_state(tensor_model_parallel_size=world):
        tp = build_layout(tp_size=world).tp_group
        found["layers"] = layers(tp, device)
        found["shards_equal_megatron_master"] = shards_equal_megatron_master(tp, device)
    return found


@on_ranks(2, 4, devices=DEVICES)
def test_layout_groups_match_megatron_core(ranks):
    world, rank, result = ranks.world, ranks.rank, results(ranks.device)
    for layout in result["layouts"]:
        what = f"{layout['order']} tp={layout['tp']} pp={layout['pp']} rank {rank}"
        for name, (mine, megatron) in layout["groups"].items():
            assert mine == megatron, f"{what}: {name} group {mine} vs megatron {megatron}"
        assert layout["ranks"][0] == layout["ranks"][1], f"{what}: (tp rank, dp rank)"
        tp = layout["tp"]
        assert layout["tp_rank_sum"] == sum(range(rank - rank % tp, rank - rank % tp + tp)), what
    described = [layout["describe"] for layout in result["layouts"]]
    assert any(f"world {world} = tp {world} x pp 1 x dp 1, order tp-dp-pp" in d for d in described)
    if world == 4:
        assert any("world 4 = tp 2 x pp 2 x dp 1, order tp-dp-pp" in d for d in described)
        assert any(
            "  tp groups: [0,1] [2,3]\n  pp groups: [0,2] [1,3]\n  dp groups: [0] [1] [2] [3]" in d for d in described
        )


@on_ranks(2, 4, devices=DEVICES)
def test_parallel_linear_layers_match_megatron_core(ranks):
    result = results(ranks.device)
    assert len(result["layers"]) == COLUMN_CASES + ROW_CASES
    for layer in result["layers"]:
        assert layer["reference"] == layer["megatron"], f"{layer['what']}: collectives differ"
        assert len(layer["reference"]) > 0 or ranks.world == 1
    assert result["shards_equal_megatron_master"]
