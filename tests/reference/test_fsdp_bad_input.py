"""Bad input to the reference FSDP: a clear one-line error, padding instead of a crash, bounded failure."""

from __future__ import annotations

from tests.launch import CRASHES, torchrun_failing
from tests.ranks import on_ranks
from tests.reference.fsdp_runs import fsdp_results


def errors(ranks) -> dict[str, str]:
    return fsdp_results(ranks.device)["bad_input"]


@on_ranks(2)
def test_parameter_shared_between_units_is_refused(ranks):
    assert errors(ranks)["shared_between_units"] == (
        "parameter 'embedding.word_embeddings.weight' is already flattened into another FSDP unit: "
        "a parameter shared between units is not supported; wrap the modules sharing it in one unit"
    )


@on_ranks(2)
def test_module_wrapped_twice_is_refused(ranks):
    assert errors(ranks)["wrapped_twice"] == (
        "TransformerBlock is already wrapped by reference FSDP; wrap each module once"
    )
    assert errors(ranks)["wrapper_wrapped"] == (
        "FullyShardedDataParallel is already wrapped by reference FSDP; wrap each module once"
    )


@on_ranks(2)
def test_non_floating_parameter_is_refused(ranks):
    assert errors(ranks)["integer_parameter"] == (
        "parameter 'step' has dtype torch.int64; FSDP shards floating-point parameters only"
    )


@on_ranks(2)
def test_unit_mixing_trainable_and_frozen_parameters_is_refused(ranks):
    assert errors(ranks)["partly_frozen"] == (
        "parameters of one unit must all require grad or all be frozen (one flat gradient); "
        "wrap frozen modules in their own unit"
    )


@on_ranks(1)
def test_world_size_one_shards_nothing_and_trains_bitwise_like_single_process(ranks):
    """Upstream FSDP1 switches to NO_SHARD (an all-reduce) at world 1; the reference keeps one code path:
    the shard is the whole padded buffer and the collectives are one-rank copies."""
    result = fsdp_results(ranks.device)
    assert result["diff"]["reference/pre/single"] == 0.0
    for unit in result["runs"]["reference/pre"]["units"]:
        assert unit["shard_numel"] == unit["padded_numel"] == unit["numel"]


@on_ranks(2, 4)
def test_flat_size_not_divisible_by_world_is_padded(ranks):
    result = fsdp_results(ranks.device)
    units = result["runs"]["reference/pre"]["units"]
    assert all(u["numel"] % ranks.world for u in units), "every flat size is indivisible, by construction"
    assert all(u["padded_numel"] % ranks.world == 0 for u in units)
    assert result["diff"]["reference/pre/single"] <= 1e-6


def test_rank_crash_mid_step_fails_fast_with_clear_error():
    message, _ = torchrun_failing(CRASHES / "fsdp_crash.py", 2)
    assert "RuntimeError: simulated rank crash: rank 1 failed in step 2" in message
    assert "exited 1" in message
    assert "finished" not in message
