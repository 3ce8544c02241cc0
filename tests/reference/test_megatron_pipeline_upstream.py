"""The close reading of Megatron-LM's 1F1B schedule, checked on megatron-core 0.16.1 itself (CPU/gloo, 4 ranks).

One launch of workers/megatron_pipeline_worker.py runs `forward_backward_pipelining_without_interleaving` (picked
by `get_forward_backward_func`) at pp 4 and at pp 2 x dp 2 with megatron's own DistributedDataParallel, and logs
per rank the forwards, backwards, p2p calls, config hooks and DP all-reduces, in order and on one clock.
What CPU/gloo cannot show: that a batch_isend_irecv is one NCCL group (gloo runs its ops one by one), the
torch.cuda.synchronize() of batch_p2p_sync (a no-op here), and CUDA-stream concurrency: an all-reduce
"overlapping" a backward is shown by when it is issued, not by kernels running side by side.
"""

from __future__ import annotations

import pytest

from reference.measure.replay import idle_fraction
from tests.launch import run_worker

pytestmark = pytest.mark.upstream("megatron-lm")


def ranks() -> list[dict]:
    """Every rank's log from one launch (shared by the tests of this module)."""
    return run_worker("megatron_pipeline_worker.py", 4, timeout=240)


def runs(name: str) -> list[dict]:
    """The run `name` on every rank, in pipeline-rank order (ties: global rank)."""
    return sorted((r["runs"][name] for r in ranks()), key=lambda run: run["pp_rank"])


def names(run: dict) -> list[str]:
    return [event[0] for event in run["events"]]


def actions(run: dict) -> list[str]:
    """F<i>/B<i> in the order the stage ran them."""
    return [n for n in names(run) if n[0] in "FB" and not n.endswith("_end")]


def backward_indices(run: dict) -> list[int]:
    return [i for i, n in enumerate(names(run)) if n[0] == "B" and not n.endswith("_end")]


@pytest.mark.parametrize("name", ["defaults_m6", "defaults_m2"])
def test_stage_r_runs_min_p_minus_r_minus_1_warmup_forwards_then_alternates(name):
    """Warm-up forwards are the ones followed by a send alone (send_forward); steady-state forwards are followed
    by send_forward_recv_backward. Stage r then holds at most min(p - r, m) micro-batches."""
    for run in runs(name):
        p, m, r = run["pp"], run["m"], run["pp_rank"]
        warmup = min(p - r - 1, m)
        order = actions(run)
        assert order[:warmup] == [f"F{i}" for i in range(warmup)], order
        if not run["last"]:
            events = run["events"]
            sends_alone = [
                e[0]
                for i, e in enumerate(events[1:], 1)
                if events[i - 1][0][0] == "F" and e[0] == "batch" and e[1] == [["isend", r + 1]]
            ]
            assert len(sends_alone) == warmup, (r, events)
        steady = order[warmup : warmup + 2 * (m - warmup)]
        assert steady == [a for i in range(m - warmup) for a in (f"F{warmup + i}", f"B{i}")], order
        assert order[warmup + 2 * (m - warmup) :] == [f"B{i}" for i in range(m - warmup, m)], order
        held = [sum(a[0] == "F" for a in order[:k]) - sum(a[0] == "B" for a in order[:k]) for k in range(len(order))]
        assert max(held) == min(p - r, m), (r, order)


@pytest.mark.parametrize("m", [6, 2])
def test_megatron_1f1b_order_is_the_reference_schedule_and_idles_p_minus_1_over_m_plus_p_minus_1(m):
    orders = [actions(run) for run in runs(f"defaults_m{m}")]
    by_pp_rank = sorted(ranks(), key=lambda r: r["runs"]["defaults_m6"]["pp_rank"])
    assert orders == [r["reference_actions"][f"m{m}"] for r in by_pp_rank]
    p = len(orders)
    assert idle_fraction(orders) == pytest.approx((p - 1) / (m + p - 1))


def test_by_default_each_p2p_round_is_one_batch_isend_irecv():
    for run in runs("defaults_m6"):
        assert run["defaults"]["batch_p2p_comm"] is True and run["defaults"]["batch_p2p_sync"] is True
        events, r = run["events"], run["pp_rank"]
        rounds = [e[1] for e in events if e[0] == "batch"]
        kinds = [op for ops in rounds for op, _ in ops]  # every transfer of the step went through a batch:
        transfers = run["m"] * ((not run["last"]) + (not run["first"]))  # m outputs on, m gradients back
        assert kinds.count("isend") == kinds.count("irecv") == transfers, (r, rounds)
        pairs = [ops for ops in rounds if len(ops) == 2]
        m, warmup = run["m"], min(run["pp"] - r - 1, run["m"])
        # one send+receive pair per steady-state forward (to the next stage) and backward (to the previous),
        # except at the ends of the pipeline and after the last steady-state backward
        expected = (0 if run["last"] else m - warmup) + (0 if run["first"] else m - warmup - 1)
        assert len(pairs) == expected, (r, rounds)
        for ops in pairs:
            assert [op for op, _ in ops] == ["isend", "irecv"] and ops[0][1] == ops[1][1], ops


def test_unbatched_rounds_send_to_next_before_receiving_and_receive_from_previous_before_sending():
    """batch_p2p_comm=False: _p2p_ops' even/odd branches give 1F1B's rounds the same order on every stage."""
    for run in runs("unbatched_m6"):
        assert "batch" not in names(run)
        r, events = run["pp_rank"], [(e[0], e[1]) for e in run["events"]]
        rounds = [
            pair
            for pair in zip(events, events[1:])
            if {pair[0][0], pair[1][0]} == {"isend", "irecv"} and pair[0][1] == pair[1][1]
        ]  # a send and a receive with one peer, back to back
        assert rounds, events
        for first, second in rounds:
            peer = first[1]
            assert (first[0], second[0]) == (("isend", "irecv") if peer == r + 1 else ("irecv", "isend")), (r, rounds)
        assert {first[1] for first, _ in rounds} == {r - 1, r + 1} - {-1, run["pp"]}


@pytest.mark.parametrize("name", ["defaults_m6", "defaults_m2"])
def test_no_sync_is_entered_before_the_first_micro_batch_and_left_just_before_the_last_backward(name):
    for run in runs(name):
        order = names(run)
        assert order[0] == "no_sync_enter", order
        exit_at, last_backward = order.index("no_sync_exit"), backward_indices(run)[-1]
        assert [i for i in backward_indices(run) if i > exit_at] == [last_backward], order
        assert not [n for n in order[exit_at + 1 : last_backward] if n[0] == "F"], order  # nothing else runs
        before = order[:exit_at]
        assert before.count("no_sync_enter") == 1 and sum(n[0] == "F" for n in before) == run["m"], order
        assert order.index("finalize_enter") > last_backward


def dp_all_reduces(run: dict) -> list[tuple[int, list]]:
    """(position in the log, event) of every all-reduce over this rank's DP group."""
    return [(i, e) for i, e in enumerate(run["events"]) if e[0] == "all_reduce" and len(e[1]) == run["dp_size"]]


def test_default_megatron_ddp_reduces_once_synchronously_after_the_last_backward():
    """overlap_grad_reduce=False: backward only accumulates; finalize_model_grads issues one blocking
    all-reduce of the whole (unbucketed) gradient buffer on every stage, after all backwards."""
    for run in runs("ddp_defaults"):
        assert run["ddp_defaults"]["overlap_grad_reduce"] is False and run["buckets"] == 1
        reduces = dp_all_reduces(run)
        assert len(reduces) == 1 and reduces[0][1][3] is False, reduces
        order = names(run)
        assert order.index("finalize_enter") < reduces[0][0] < order.index("finalize_exit")
        assert reduces[0][0] > max(i for i, n in enumerate(order) if n.endswith("_end") and n[0] == "B")


def last_backward_span(run: dict) -> tuple[int, int]:
    order = names(run)
    start = backward_indices(run)[-1]
    return start, order.index(order[start] + "_end", start)


def test_overlap_grad_reduce_issues_bucket_all_reduces_while_the_last_backward_runs():
    """overlap_grad_reduce=True, no grad_sync_func: every stage leaves no_sync before its last backward and
    its buckets' asynchronous all-reduces start inside it; the first stage's first bucket before its first
    layer's backward. Only the first stage is bucketed (one bucket on the others)."""
    for run in runs("ddp_overlap"):
        start, end = last_backward_span(run)
        reduces = dp_all_reduces(run)
        assert reduces and all(start < i < end and e[3] is True for i, e in reduces), (start, end, reduces)
        if run["first"]:
            layer_boundary = names(run).index("bwd_layer1_done", start)
            assert reduces[0][0] < layer_boundary < reduces[1][0], names(run)[start : end + 1]


def test_with_grad_sync_func_only_the_first_stage_reduces_in_its_last_backward_the_others_in_the_bubble():
    """grad_sync_func = start_grad_sync (megatron training under overlap_grad_reduce and its default
    align_grad_reduce): later stages keep no_sync through their last backward and issue their all-reduce
    after it, while the first stage is still draining the pipeline."""
    by_stage = runs("ddp_overlap_align")
    first = [run for run in by_stage if run["first"]]
    for run in by_stage:
        start, end = last_backward_span(run)
        reduces, order = dp_all_reduces(run), names(run)
        if run["first"]:
            assert reduces and all(start < i < end for i, _ in reduces) and "grad_sync_func" not in order
            continue
        assert order.index("no_sync_exit") > end and "grad_sync_func" in order
        assert [i for i, _ in reduces] and all(
            order.index("grad_sync_func") < i < order.index("finalize_enter") for i, _ in reduces
        )
        issued = run["events"][reduces[0][0]][-1]
        for stage0 in first:  # this stage is idle until the first stage's last backward ends: its bubble
            assert run["events"][end][-1] < issued < stage0["events"][last_backward_span(stage0)[1]][-1]


def test_each_loss_is_divided_by_num_microbatches_before_backward():
    """Two outputs: loss / m (x the context-parallel size, 1 here). Three: loss / num_tokens / m, unless
    calculate_per_token_loss, where backward starts from the sum and megatron's finalize_model_grads divides the
    gradients by the global token count."""
    for name, divide in [
        ("defaults_m6", lambda loss, tokens, m: loss / m),
        ("three_output_m6", lambda loss, tokens, m: loss / tokens / m),
        ("per_token_m6", lambda loss, tokens, m: loss),
    ]:
        last = runs(name)[-1]
        assert last["last"]
        losses = {e[1]: e for e in last["events"] if e[0] == "loss"}
        starts = [e for e in last["events"] if e[0][0] == "B" and not e[0].endswith("_end")]
        assert len(starts) == last["m"] == len(losses)
        for e in starts:
            loss = losses[int(e[0][1:])]
            tokens = loss[3] if len(loss) > 4 else None
            assert e[2] == pytest.approx(divide(loss[2], tokens, last["m"]), rel=1e-6), (name, e, loss)
        finalize = next(e for e in last["events"] if e[0] == "finalize_enter")
        assert finalize[1] == (6 * 8 if name == "per_token_m6" else False), finalize
    for per_token, per_micro_batch in zip(runs("per_token_m6"), runs("three_output_m6")):
        # finalize_model_grads divided the summed gradients by the 48 tokens: the same as / 8 / m here
        flat = [[x for grad in run["grads"] for x in grad] for run in (per_token, per_micro_batch)]
        assert flat[0] == pytest.approx(flat[1], rel=1e-5, abs=1e-7)


def test_deallocate_pipeline_outputs_is_off_by_default_and_shrinks_sent_outputs_to_one_element():
    defaults, deallocated = runs("defaults_m6"), runs("deallocate_m6")
    for plain, freed in zip(defaults, deallocated):
        assert plain["defaults"]["deallocate_pipeline_outputs"] is False
        sizes = {e[1] for e in plain["events"] if e[0][0] == "B" and not e[0].endswith("_end")}
        freed_sizes = {e[1] for e in freed["events"] if e[0][0] == "B" and not e[0].endswith("_end")}
        assert freed_sizes == {1} and sizes == ({1} if plain["last"] else {4 * 2 * 8}), (sizes, freed_sizes)
        assert freed["grads"] == plain["grads"]  # custom_backward gives the same gradients
    assert "Mismatch in shape" in ranks()[0]["deallocated_plain_backward"]


def test_the_interleaved_schedule_picked_for_virtual_stages_idles_v_times_less():
    """get_forward_backward_func picks forward_backward_pipelining_with_interleaving when virtual stages are set;
    its recorded order at p 4, v 2 chunks, m 8 idles (p - 1)/(v m + p - 1), against (p - 1)/(m + p - 1)."""
    by_pp_rank = sorted(ranks(), key=lambda r: r["runs"]["defaults_m6"]["pp_rank"])
    assert by_pp_rank[0]["with_virtual_stages"] == "forward_backward_pipelining_with_interleaving"
    p, v, m = 4, 2, 8
    interleaved = idle_fraction([r["interleaved_v2_m8"] for r in by_pp_rank], chunks=v)
    plain = idle_fraction([r["defaults_m8"] for r in by_pp_rank])
    assert interleaved == pytest.approx((p - 1) / (v * m + p - 1)) and plain == pytest.approx((p - 1) / (m + p - 1))


def test_megatron_ddp_buckets_only_the_first_stage_and_reduces_in_the_parameters_dtype():
    for run in runs("ddp_overlap"):  # a bucket per layer asked for: granted on the first stage only
        assert run["buckets"] == (2 if run["first"] else 1), run["buckets"]
    for rank in ranks():
        assert rank["bf16_grad_dtypes"] == {"default": "torch.bfloat16", "grad_reduce_in_fp32": "torch.float32"}


@pytest.mark.parametrize("v, m", [(2, 8), (2, 4), (3, 4)])
def test_megatron_interleaved_order_is_the_reference_interleaved_1f1b(v, m):
    """forward_backward_pipelining_with_interleaving at p 4 (v chunks; m 4 puts every forward of rank 0 in the
    warm-up) runs on each rank the order reference.pipeline.interleaved runs on the same PP group."""
    by_pp_rank = sorted(ranks(), key=lambda r: r["runs"]["defaults_m6"]["pp_rank"])
    megatron = [r[f"interleaved_v{v}_m{m}"] for r in by_pp_rank]
    assert megatron == [r["reference_interleaved"][f"v{v}_m{m}"] for r in by_pp_rank]
    p = len(megatron)
    for r, order in enumerate(megatron):  # the warm-up of get_pp_rank_microbatches, then one F per B
        warmup = min(2 * (p - r - 1) + (v - 1) * p, v * m)
        assert next((i for i, a in enumerate(order) if a[0] == "B"), len(order)) == min(warmup + 1, v * m)


def test_megatron_refuses_interleaving_when_m_is_not_a_multiple_of_p():
    """Its default microbatch_group_size_per_vp_stage is p; m 6 at p 4 leaves a last group of 2 < p."""
    for rank in ranks():
        assert rank["interleaved_m6_refused"].startswith("RuntimeError: The remainder of M"), rank[
            "interleaved_m6_refused"
        ]
        assert "but it is 2" in rank["interleaved_m6_refused"]


def test_megatron_assigns_chunk_c_of_rank_r_the_layers_of_virtual_stage_c_p_plus_r():
    """get_transformer_layer_offset / get_num_layers_to_build (in-process, no ranks needed) give the split of
    reference.gpt.model.split_virtual_stages, and refuse layer counts that p x v does not divide."""
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from reference.gpt.model import split_virtual_stages

    for layers, p, v in [(8, 2, 2), (8, 2, 4), (12, 4, 3), (8, 4, 2)]:
        config = TransformerConfig(
            num_layers=layers,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=p,
            virtual_pipeline_model_parallel_size=v,
        )
        megatron = [
            [
                (
                    get_transformer_layer_offset(config, vp_stage=c, pp_rank=r),
                    get_transformer_layer_offset(config, vp_stage=c, pp_rank=r)
                    + get_num_layers_to_build(config, vp_stage=c, pp_rank=r),
                )
                for c in range(v)
            ]
            for r in range(p)
        ]
        assert megatron == split_virtual_stages(layers, p, v), (layers, p, v)
    # two assertions: the layers must split over p stages, then each stage's over v chunks
    for p, v, message in [(4, 2, "divisible by pipeline_model_parallel_size"), (2, 2, "divisible by vp_size")]:
        config = TransformerConfig(
            num_layers=6,
            hidden_size=8,
            num_attention_heads=1,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_size=p,
            virtual_pipeline_model_parallel_size=v,
        )
        with pytest.raises(AssertionError, match=message):
            get_num_layers_to_build(config, vp_stage=0, pp_rank=0)
