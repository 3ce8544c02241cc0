"""Megatron's mixed precision and the distributed optimizer (ZeRO-1) in reference.data_parallel.

One 4-rank launch of workers/distributed_optimizer_worker.py trains the bf16 test transformer (hidden 16, an odd
MLP width 61 so that buckets need padding) with Adam for three steps at DP 4 and DP 2, with the unsharded
mixed precision optimizer (the oracle: fp32 main_grad all-reduced, fp32 masters of every parameter on every
rank) and with the distributed optimizer (reduce-scatter, step this rank's slice, all-gather), with and without
overlapping the all-gathers with the next forward, with fp32 and with bf16 gradients.
"""

from __future__ import annotations

import pytest

from tests.launch import run_worker

DISTRIBUTED = ["distopt", "distopt/overlap_param_gather", "distopt/bf16_grads"]


def results() -> list[dict]:
    return run_worker("distributed_optimizer_worker.py", 4, timeout=300)


def runs(dp: str, config: str) -> list[dict]:
    return [result["dp"][dp]["runs"][config] for result in results()]


def ops(step: list[dict], op: str) -> list[dict]:
    return [e for e in step if e["op"] == op]


@pytest.mark.parametrize("dp", ["dp2", "dp4"])
@pytest.mark.parametrize("config", DISTRIBUTED)
def test_distributed_optimizer_equals_the_unsharded_step_bit_for_bit(dp, config):
    """Reduce-scatter then all-gather sums the same terms in the same order as gloo's all-reduce, and Adam is
    elementwise, so slicing changes no bit: parameters, fp32 master slices and losses are equal."""
    for run in runs(dp, config):
        diff = run["diff"]
        assert diff["params_bitwise"] and diff["params"] == 0.0
        assert diff["masters"] == 0.0 and diff["losses"] == 0.0


def test_buckets_are_padded_to_a_multiple_of_the_dp_size():
    for dp, n in (("dp2", 2), ("dp4", 4)):
        for run in runs(dp, "distopt"):
            assert run["numel"] % n != 0 or run["padded_numel"] > run["numel"], "the test model needs padding"
            assert run["padded_numel"] % n == 0
            assert 0 < run["padded_numel"] - run["numel"] < n * run["buckets"]


@pytest.mark.parametrize("config", ["oracle", "distopt"])
def test_mixed_precision_keeps_bf16_parameters_fp32_main_grads_and_fp32_masters(config):
    for run in runs("dp2", config):
        facts = run["facts"]
        assert facts["param_dtype"] == "torch.bfloat16" and facts["main_grad_dtype"] == "torch.float32"
        assert facts["grad_is_none"], "the hook moves each bf16 .grad into main_grad and drops it"
        assert facts["master_dtypes"] == ["torch.float32"]
        assert facts["master_rounds_to_param"], "the bf16 parameter is its fp32 master rounded"
        assert facts["master_finer_than_param"] > 0, "the masters hold bits the bf16 parameters do not"


@pytest.mark.parametrize("dp, n", [("dp2", 2), ("dp4", 4)])
def test_bytes_per_rank_are_the_zero_paper_accounting(dp, n):
    """ZeRO (Rajbhandari et al. 2020), stage 1: 2Ψ bf16 parameters + 2Ψ bf16 gradients + 12Ψ/N optimizer
    (4 fp32 master + 4 + 4 Adam moments). Megatron with fp32 main gradients: 4Ψ of gradients, so 6Ψ + 12Ψ/N.
    Ψ is the padded bucket size (at most N - 1 elements per bucket more than the model)."""
    accounting = [  # (configuration, what Ψ counts, gradient bytes per parameter, ranks sharing the optimizer)
        ("distopt/bf16_grads", "padded_numel", 2, n),
        ("distopt", "padded_numel", 4, n),
        ("oracle", "numel", 4, 1),  # unsharded: 2 + 4 + 12 bytes per parameter on every rank
    ]
    for config, counted, gradient_bytes, shards in accounting:
        for run in runs(dp, config):
            psi = run[counted]
            assert run["bytes"] == {
                "parameters": 2 * psi,
                "gradients": gradient_bytes * psi,
                "master_weights": 4 * psi // shards,
                "optimizer_states": 8 * psi // shards,
            }, config


@pytest.mark.parametrize("dp", ["dp2", "dp4"])
def test_traffic_per_step_reduce_scatter_plus_all_gather_is_an_all_reduce(dp):
    """Per rank a ring all-reduce moves 2(N-1)/N of its buffer, a reduce-scatter and an all-gather (N-1)/N
    each: with bf16 gradients the distributed optimizer sends what DDP sends; with fp32 gradients and bf16
    parameters 4 + 2 = 6 bytes per parameter against DDP's 8. Recorded nbytes are full-buffer sizes."""
    for bf16, ddp, distopt in zip(runs(dp, "oracle/bf16_grads"), runs(dp, "distopt/bf16_grads"), runs(dp, "distopt")):
        psi, padded = distopt["numel"], distopt["padded_numel"]
        for step in range(len(bf16["steps"])):
            all_reduce = sum(e["nbytes"] for e in ops(bf16["steps"][step], "all_reduce"))
            assert all_reduce == 2 * psi
            both = ops(ddp["steps"][step], "reduce_scatter") + ops(ddp["steps"][step], "all_gather")
            assert sum(e["nbytes"] for e in both) == 2 * (2 * padded)  # = 2 x all-reduce bytes, padded
            fp32 = distopt["steps"][step]
            assert sum(e["nbytes"] for e in ops(fp32, "reduce_scatter")) == 4 * padded
            assert {e["dtype"] for e in ops(fp32, "reduce_scatter")} == {"float32"}
            assert sum(e["nbytes"] for e in ops(fp32, "all_gather")) == 2 * padded
            assert {e["dtype"] for e in ops(fp32, "all_gather")} == {"bfloat16"}


def test_reduce_scatters_overlap_backward_and_all_gathers_follow_the_step():
    for run in runs("dp4", "distopt"):
        for step in run["steps"]:
            kinds = [e["op"] for e in step]
            assert kinds == ["reduce_scatter"] * run["buckets"] + ["all_gather"] * run["buckets"]
            assert all(e["phase"] == "backward" for e in ops(step, "reduce_scatter"))
            assert all(e["in_step"] for e in ops(step, "all_gather"))


def test_overlapped_all_gathers_run_in_the_next_forward():
    """overlap_param_gather: the step issues only the first bucket the forward needs; every other bucket's
    all-gather is issued by a forward pre-hook, before that step's backward starts reduce-scattering."""
    for run in runs("dp4", "distopt/overlap_param_gather"):
        later = run["steps"][1]
        first_reduce_scatter = [e["op"] for e in later].index("reduce_scatter")
        in_forward = [e for e in later[:first_reduce_scatter] if e["op"] == "all_gather"]
        assert len(in_forward) == run["buckets"] - 1
        assert all(e["phase"] == "forward" and not e["in_step"] for e in in_forward)
        assert [e["in_step"] for e in ops(later, "all_gather")][-1] is True


def test_bad_input_is_refused_with_a_message():
    errors = results()[0]["bad_input"]
    assert "use_distributed_optimizer=True" in errors["distopt_on_plain_ddp"]
    assert "needs use_distributed_optimizer=True" in errors["overlap_param_gather_without_distopt"]
    assert "reduce-scattered" in errors["unsharded_on_sharded_ddp"]


def megatron_results() -> list[dict]:
    return run_worker("megatron_distopt_worker.py", 2, timeout=240)


@pytest.mark.upstream("megatron-lm")
def test_megatron_distributed_optimizer_and_the_reference_train_bit_for_bit():
    """megatron-core's DistributedOptimizer (get_megatron_optimizer, bf16, torch AdamW without TE/Apex) and the
    reference, same MLP, seed and data at DP 2: equal losses and bf16 parameters after three steps, although
    megatron pads its buffer differently and slices its masters at parameter boundaries."""
    for result in megatron_results():
        megatron, reference = result["megatron"], result["reference"]
        assert (megatron["optimizer_class"], megatron["inner_class"]) == ("DistributedOptimizer", "AdamW")
        assert megatron["losses"] == reference["losses"]
        assert megatron["params"] == reference["params"]


@pytest.mark.upstream("megatron-lm")
def test_megatron_holds_fp32_main_grads_and_a_twelve_byte_optimizer_share():
    """Megatron's accounting with grad_reduce_in_fp32: bf16 parameter buffer (2 bytes) + fp32 gradient buffer
    (4 bytes) per padded element on every rank, and 4 + 4 + 4 bytes of master and Adam moments per *model*
    element of this rank's slice: its masters skip the padding, the reference's flat slices keep it."""
    results = megatron_results()
    for result in results:
        megatron = result["megatron"]
        padded = megatron["grad_buffer"]["numel"]
        assert megatron["grad_buffer"]["dtype"] == "torch.float32" and megatron["param_buffer"] == {
            "numel": padded,
            "dtype": "torch.bfloat16",
        }
        assert padded % 128 == 0 and padded > megatron["numel_unpadded"]  # lcm(dp, 128), params 64-aligned
        assert megatron["state_bytes"] == 2 * megatron["master_bytes"]
    assert sum(r["megatron"]["master_bytes"] for r in results) == 4 * results[0]["megatron"]["numel_unpadded"]
    for result in results:  # the reference pads the one bucket only to a multiple of dp
        numel = result["megatron"]["numel_unpadded"]
        padded = numel + numel % 2
        assert result["reference"]["bytes"] == {
            "parameters": 2 * padded,
            "gradients": 4 * padded,
            "master_weights": 2 * padded,
            "optimizer_states": 4 * padded,
        }


@pytest.mark.upstream("megatron-lm")
def test_megatron_reduce_scatters_fp32_and_all_gathers_bf16_like_the_reference():
    """Per step one fp32 reduce-scatter of the gradient buffer and one bf16 all-gather of the parameter buffer
    after the step; megatron adds one fp32 scalar all-reduce, the gradient norm ChainedOptimizer.step computes
    for logging. The reduce-scatter runs in backward (overlap_grad_reduce) from the second step on: in the
    first, megatron's DDP records which gradients fill its bucket and issues it in finish_grad_sync."""
    for result in megatron_results():
        megatron, reference = result["megatron"], result["reference"]
        padded = megatron["grad_buffer"]["numel"]
        for step, (theirs, ours) in enumerate(zip(megatron["steps"], reference["steps"])):
            assert [(e["op"], e["dtype"]) for e in theirs] == [
                ("reduce_scatter", "float32"),
                ("all_reduce", "float32"),
                ("all_gather", "bfloat16"),
            ]
            assert [e["nbytes"] for e in theirs] == [4 * padded, 4, 2 * padded]
            assert [(e["op"], e["dtype"], e["phase"]) for e in ours] == [
                ("reduce_scatter", "float32", "backward"),
                ("all_gather", "bfloat16", "forward"),
            ]
            assert theirs[0]["phase"] == ("forward" if step == 0 else "backward")


@pytest.mark.upstream("megatron-lm")
def test_megatron_ties_the_embedding_across_stages_as_the_reference_does():
    """megatron-core's GPTModel at PP 2 with share_embeddings_and_output_weights (its default): the embedding
    group is the pipeline's first and last rank, the last stage's copy equals the first stage's embedding
    after construction (zeroed, then all-reduced), and finalize_model_grads sums the two copies' main_grad
    (1 + 2 on both ends) in one all-reduce of the whole matrix over that group: what
    reference.pipeline.tied_embeddings does (tests/reference/test_tied_embeddings.py)."""
    results = [r["tied"] for r in megatron_results()]
    assert [r["first"] for r in results] == [True, False]
    for tied in results:
        assert tied["embedding_group"] == [0, 1] and tied["ends_equal_after_construction"]
        assert tied["main_grad_after_finalize"] == [3.0]
        assert tied["embedding_group_all_reduces"] == [tied["weight_bytes"]] == [64 * 16 * 4]
