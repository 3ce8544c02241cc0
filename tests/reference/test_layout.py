"""The TP x PP x DP layout: the issue's 8-rank example, megatron-core's RankGenerator for many sizes and both
orders (and its expert groups, EP carved out of DP), and the `python -m reference.layout` command (text and
--json in-process, a refused size end to end)."""

import json
import subprocess
import sys

import pytest
from megatron.core.parallel_state import RankGenerator

from reference.layout import main
from reference.parallel_state import Mesh, ParallelConfigError, parallel_sizes
from tests.launch import ROOT


def test_eight_ranks_tp2_pp2_dp2_groups():
    mesh = Mesh(2, 2, 2)
    assert mesh.ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert mesh.ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh.ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("order", ["tp-pp-dp", "tp-dp-pp"])
@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (1, 4, 2), (4, 1, 2), (2, 4, 1), (8, 8, 64), (4, 2, 3)])
def test_groups_equal_megatron_rank_generator(tp, pp, dp, order):
    theirs = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order=order.replace("tp-", "tp-cp-ep-"))
    mesh = Mesh(tp, pp, dp, order=order)
    for kind in ("tp", "pp", "dp"):
        assert mesh.ranks(kind) == sorted(theirs.get_ranks(kind)), kind


@pytest.mark.parametrize(
    "tp,pp,dp,ep,order",
    [
        (1, 1, 4, 2, "tp-pp-dp"),
        (2, 1, 2, 2, "tp-pp-dp"),
        (2, 1, 4, 2, "tp-dp-pp"),
        (2, 2, 4, 2, "tp-dp-pp"),
        (1, 2, 8, 4, "tp-dp-pp"),
        (4, 4, 16, 8, "tp-dp-pp"),
        (8, 1, 64, 8, "tp-pp-dp"),
    ],
)
def test_expert_groups_equal_megatron_rank_generator(tp, pp, dp, ep, order):
    """megatron-core's initialize_model_parallel builds its expert groups with a RankGenerator of the expert
    tensor-parallel size (by default the TP size), EP, dp / EP and PP, in the same order string."""
    theirs = RankGenerator(tp=tp, ep=ep, dp=dp // ep, pp=pp, cp=1, order=order.replace("tp-", "tp-cp-ep-"))
    mesh = Mesh(tp, pp, dp, ep=ep, order=order)
    assert mesh.ranks("ep") == sorted(theirs.get_ranks("ep"))
    assert mesh.ranks("edp") == sorted(theirs.get_ranks("dp"))
    assert mesh.ranks("tp") == sorted(theirs.get_ranks("tp"))  # expert TP = TP
    assert mesh.ranks("pp") == sorted(theirs.get_ranks("pp"))


@pytest.mark.parametrize(
    "tp,cp,pp,dp,ep,order",
    [
        (2, 2, 2, 2, 1, "tp-pp-dp"),
        (2, 2, 2, 2, 1, "tp-dp-pp"),
        (2, 2, 1, 2, 4, "tp-pp-dp"),
        (1, 4, 2, 2, 2, "tp-dp-pp"),
        (2, 3, 2, 2, 3, "tp-dp-pp"),
    ],
)
def test_context_parallel_groups_and_ep_over_dp_x_cp_equal_megatron_rank_generator(tp, cp, pp, dp, ep, order):
    """CP varies right after TP ("tp-cp-ep-dp-pp"); the experts' data-parallel size is dp x cp / ep, as
    megatron-core's expert RankGenerator (cp 1 there) carves it."""
    megatron_order = order.replace("tp-", "tp-cp-ep-")
    dense = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=megatron_order)
    experts = RankGenerator(tp=tp, ep=ep, dp=dp * cp // ep, pp=pp, cp=1, order=megatron_order)
    mesh = Mesh(tp, pp, dp, cp=cp, ep=ep, order=order)
    for kind in ("tp", "cp", "pp", "dp"):
        assert mesh.ranks(kind) == sorted(dense.get_ranks(kind)), kind
    assert mesh.ranks("ep") == sorted(experts.get_ranks("ep"))
    assert mesh.ranks("edp") == sorted(experts.get_ranks("dp"))


def test_hsdp_splits_each_dp_group_into_replicas_of_consecutive_shards():
    """dp = dp_replicate x dp_shard, shard fastest (torchtitan's dims): each DP group's rows shard, its columns
    replicate; the embedding group pairs each pipeline's ends."""
    mesh = Mesh(2, 2, 4, dp_replicate=2)
    assert mesh.ranks("dp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert mesh.ranks("dp_shard")[:2] == [[0, 4], [1, 5]] and mesh.ranks("dp_replicate")[:2] == [[0, 8], [1, 9]]
    assert mesh.ranks("embedding") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]


def test_expert_parallelism_is_carved_out_of_data_parallelism():
    with pytest.raises(ParallelConfigError, match=r"data-parallel size \(4\) is not divisible by the expert-parallel"):
        Mesh(1, 1, 4, ep=3)
    with pytest.raises(ParallelConfigError, match="expert parallelism with pipeline stages needs order tp-dp-pp"):
        Mesh(1, 2, 2, ep=2, order="tp-pp-dp")


def test_sizes_must_multiply_to_the_world():
    assert parallel_sizes(8, 2, 2) == (2, 2, 2)
    with pytest.raises(ParallelConfigError, match=r"tp 2 x pp 2 x dp 3 = 12 ranks, but the world has 8"):
        parallel_sizes(8, 2, 2, 3)
    with pytest.raises(ParallelConfigError, match=r"the world size \(8\) is not divisible by tp 3 x pp 1 \(3\)"):
        parallel_sizes(8, 3)


def test_layout_command_prints_text_and_json(capsys):
    """main() in this process; test_layout_command_refuses_in_one_line runs the command itself."""
    assert main(["--tp", "2", "--pp", "2", "--dp", "2", "--rank", "5"]) == 0
    text = capsys.readouterr().out
    assert "pp groups: [0,2] [1,3] [4,6] [5,7]" in text
    assert "rank 5: tp 1, pp 0, dp 1" in text
    assert main(["--tp", "8", "--pp", "8", "--world", "4096", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["dp"], len(data["tp_groups"]), len(data["dp_groups"])) == (64, 512, 64)
    assert data["dp_groups"][0] == list(range(0, 4096, 64))
    assert main(["--tp", "2", "--dp", "4", "--ep", "2", "--rank", "3"]) == 0
    text = capsys.readouterr().out
    assert "ep groups: [0,2] [1,3] [4,6] [5,7]\n  expert dp groups: [0,4] [1,5] [2,6] [3,7]" in text
    assert "rank 3: tp 1, pp 0, dp 1, ep 1" in text
    assert main(["--tp", "2", "--cp", "2", "--dp", "2", "--rank", "2"]) == 0
    text = capsys.readouterr().out
    assert "world 8 = tp 2 x cp 2 x pp 1 x dp 2, order tp-cp-pp-dp" in text
    assert "cp groups: [0,2] [1,3] [4,6] [5,7]" in text and "rank 2: tp 0, cp 1, pp 0, dp 0" in text


def test_layout_command_refuses_in_one_line():
    """The one end-to-end `python -m reference.layout` run."""
    refused = subprocess.run(
        [sys.executable, "-m", "reference.layout", "--tp", "2", "--pp", "2", "--dp", "3", "--world", "8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == "reference.layout: error: tp 2 x pp 2 x dp 3 = 12 ranks, but the world has 8"
