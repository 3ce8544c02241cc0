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
import re
from pathlib import Path

import pytest

from reference.parallel_state import ParallelConfigError
from reference.tensor_parallel.vocab_parallel import pad_vocab_size
from tests.reference.gpus import WORLDS, launch_world, world_id

WORKER = Path(__file__).parent / "workers" / "vocab_parallel_worker.py"


@pytest.fixture(scope="module", params=WORLDS, ids=world_id)
def run(request):
    return launch_world(request.param, WORKER)


def test_vocab_parallel_matches_unsharded(run):
    world, out = run
    assert out.count("vocab parallel vs unsharded ok") == world


def test_vocab_parallel_matches_megatron_core(run):
    world, out = run
    assert out.count("megatron comparisons ok") == world
    # the loss's three all-reduces of one fp32 number per token, forward only; nothing in backward
    s, b = 8, 2
    assert (f"figures: collectives cross_entropy: [('all_reduce', ({s}, {b}), 'forward'), "
            f"('all_reduce', ({s}, {b}), 'forward'), ('all_reduce', ({s}, {b}), 'forward')]") in out


def test_no_rank_allocates_full_logits(run):
    world, out = run
    assert out.count("allocation probe ok") == world
    padded = pad_vocab_size(50, world)
    lines = re.findall(r"figures: probe tp=\d+ sp=(\w+) .*: rank (\d+) .* largest \(([\d, ]+)\) .*"
                       r"\((\d+) elements <= tokens\*V_p/tp = (\d+)\)", out)
    assert len(lines) == 2 * world, out[-3000:]
    for _sp, _rank, shape, numel, bound in lines:  # the largest tensor on every rank: one logits shard
        assert int(shape.split(",")[-1]) == padded // world and int(numel) == int(bound) == 16 * padded // world
    assert "figures: probe unsharded V=50" in out and "largest (16, 50)" in out


def test_bad_input_raises_one_line_errors(run):
    world, out = run
    assert out.count("bad input ok") == world


@pytest.mark.parametrize("vocab, tp, multiple, padded", [(50, 2, 1, 50), (50, 4, 1, 52), (5, 4, 1, 8),
                                                         (50257, 8, 128, 51200), (1, 1, 1, 1)])
def test_pad_vocab_size(vocab, tp, multiple, padded):
    assert pad_vocab_size(vocab, tp, multiple) == padded


def test_pad_vocab_size_refuses_nonpositive_sizes():
    with pytest.raises(ParallelConfigError, match="must be positive"):
        pad_vocab_size(0, 2)
