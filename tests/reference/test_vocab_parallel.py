"""Vocab-parallel embedding and loss parallelism (one launch per TP size, megatron's import is slow):

* VocabParallelEmbedding equals torch.nn.Embedding from the same master weight (output, weight grad), with
  and without sequence parallelism, for vocabularies TP divides and does not divide (padded);
* vocab_parallel_cross_entropy equals F.cross_entropy on the full logits (loss, grad wrt the logits), and
  ParallelLMHead (hidden -> loss) equals an unsharded Linear + cross_entropy (loss, dW, dhidden); padding
  columns do not change the loss and get zero gradient;
* against megatron-core 0.16.1: the same numbers and the identical recorded collective sequence;
* no rank ever allocates full logits: every tensor produced in forward + backward of head + loss is recorded
  (a TorchDispatchMode), none has the (padded) vocabulary as a dimension and the largest has at most
  tokens * V_p / tp elements; the same probe does see [tokens, V] logits in the unsharded computation;
* bad input: token or target ids outside the vocabulary (pad ids included) raise a one-line error.
"""

import math

import pytest

from reference.parallel_state import ParallelConfigError
from reference.tensor_parallel.vocab_parallel import pad_vocab_size
from tests.launch import run_worker
from tests.reference.gpus import WORLDS, world_id

S, B, V_PROBE = 8, 2, 50


@pytest.fixture(scope="module", params=WORLDS, ids=world_id)
def run(request):
    world, device = request.param
    return world, run_worker("vocab_parallel_worker.py", world, device=device, timeout=180)


def test_vocab_parallel_matches_unsharded(run):
    world, results = run
    vocabs = [12 * world, 6 * world + 1, 5]  # divisible by TP, padded, and (TP=4) a rank holding only padding
    for result in results:  # each rank asserted equal numbers; this is what it compared
        assert result["unsharded"] == [
            what
            for vocab in vocabs
            for what in (
                [f"{kind} V={vocab} sp={sp}" for sp in (False, True) for kind in ("embedding", "lm_head")]
                + [f"cross_entropy V={vocab} scale={scale}" for scale in (1.0, 50.0)]
            )
        ]


def test_vocab_parallel_matches_megatron_core(run):
    world, results = run
    for result in results:
        assert sorted(result["collectives"]) == [
            "cross_entropy",
            "embedding sp=False",
            "embedding sp=True",
            "lm_head sp=False",
            "lm_head sp=True",
        ]
        # the loss's three all-reduces of one fp32 number per token, forward only; nothing in backward
        assert result["collectives"]["cross_entropy"] == [["all_reduce", [S, B], "forward"]] * 3


def test_no_rank_allocates_full_logits(run):
    world, results = run
    padded = pad_vocab_size(V_PROBE, world)
    for result in results:
        for sp in (False, True):  # the largest tensor on every rank: one logits shard
            probe = result["probe"][f"sp={sp}"]
            assert probe["largest"][-1] == padded // world, probe
            assert math.prod(probe["largest"]) == probe["bound"] == 16 * padded // world, probe
        assert result["probe"]["unsharded"]["full_vocabulary_tensors"] > 0
        assert result["probe"]["unsharded"]["largest"] == [16, V_PROBE]


def test_bad_input_raises_one_line_errors(run):
    world, results = run
    for result in results:  # each message was checked on its rank: one line, naming the problem
        assert len(result["bad_input"]) == 3 * 2 + 4
    assert all(result["bad_input"] == results[0]["bad_input"] for result in results), "ranks disagree"


@pytest.mark.parametrize(
    "vocab, tp, multiple, padded", [(50, 2, 1, 50), (50, 4, 1, 52), (5, 4, 1, 8), (50257, 8, 128, 51200), (1, 1, 1, 1)]
)
def test_pad_vocab_size(vocab, tp, multiple, padded):
    assert pad_vocab_size(vocab, tp, multiple) == padded


def test_pad_vocab_size_refuses_nonpositive_sizes():
    with pytest.raises(ParallelConfigError, match="must be positive"):
        pad_vocab_size(0, 2)
