"""Vocab-parallel embedding and loss parallelism at TP = world (2 and 4 ranks, and 2 GPUs):

* VocabParallelEmbedding equals nn.Embedding from the same master weight, with and without sequence
  parallelism, for vocabularies TP divides and pads;
* vocab_parallel_cross_entropy equals F.cross_entropy on the full logits, LMHead an unsharded Linear +
  cross_entropy (loss, dW, dhidden); padding columns change nothing and get zero gradient;
* megatron-core 0.16.1 gives the same numbers and collective sequence (on CPU, its
  torch.cuda.current_device() allocations are redirected there);
* no rank allocates full logits: of every tensor forward and backward produce (a TorchDispatchMode), none has
  the padded vocabulary as a dimension and the largest holds at most tokens * V_p / tp elements, while the
  unsharded computation shows [tokens, V];
* ids outside the vocabulary (pad ids included) raise a one-line error.
"""

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel as megatron_tp
from megatron.core.model_parallel_config import ModelParallelConfig
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from reference.measure.recorder import CollectiveRecorder
from reference.measure.torch_patches import cuda_calls_on_cpu
from reference.parallel_state import ParallelConfigError, build_layout
from reference.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from reference.tensor_parallel.transformer import init_method_normal
from reference.tensor_parallel.vocab_parallel import LMHead, VocabParallelEmbedding, pad_vocab_size
from tests.ranks import on_ranks
from tests.reference.gpus import DEVICES
from tests.reference.helpers import assert_close, every_rank, gather_dim, megatron_parallel_state

S, B, H = 8, 2, 8  # 16 tokens; H < tokens so a logits shard is the largest tensor of the head
V_TINY = 5  # at TP=4 padded to 8: the last rank holds only padding
V_PROBE = 50  # no dimension of the test collides with 50 or its padded size / shards (52, 25, 13)


def gen(seed):
    return torch.Generator().manual_seed(seed)


def check_pad_rows(grad_full, vocab, what):
    assert torch.count_nonzero(grad_full[vocab:]) == 0, f"{what}: padding rows/columns got a non-zero gradient"


def record(fn):
    with CollectiveRecorder() as rec:
        result = fn()
    return result, [(e.key(), e.phase) for e in rec.events]


def compare_collectives(what, mine, theirs):
    assert mine == theirs, f"{what}: collectives differ\nreference {mine}\nmegatron  {theirs}"
    assert mine, f"{what}: no collective recorded"


def expect_error(fn, *needles, error=ParallelConfigError):
    try:
        fn()
    except error as exc:
        message = str(exc)
        assert "\n" not in message and all(n in message for n in needles), message
        return message
    raise AssertionError(f"expected {error.__name__} mentioning {needles}")


class AllocationProbe(TorchDispatchMode):
    """Records the shape of every tensor any op produces (forward and backward, collectives included)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [
            (str(func.overloadpacket), tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, torch.Tensor)
        ]
        return out

    def largest(self):
        return max(self.shapes, key=lambda item: torch.Size(item[1]).numel())


class Checks:
    """The checks at TP = world on this rank's device."""

    def __init__(self, device: torch.device):
        self.device, self.world, self.rank = device, dist.get_world_size(), dist.get_rank()
        self.tp = build_layout(tp_size=self.world).tp_group
        self.v_even = 12 * self.world  # divisible by TP
        self.v_odd = 6 * self.world + 1  # padded to 7 * world

    def token_ids(self, vocab, shape, seed):
        ids = torch.randint(vocab, shape, generator=gen(seed))
        ids.view(-1)[:2] = torch.tensor([0, vocab - 1])  # both ends of the vocabulary, every time
        return ids.to(self.device)

    def reference_layer(self, layer_class, *sizes, seed, sp=False):
        """The reference's VocabParallelEmbedding or LMHead on this rank, drawn from `seed`: its shards
        are rows of master_weight(vocab, seed) and megatron_layer's from the same seed."""
        torch.manual_seed(seed)
        return layer_class(
            *sizes, tp_group=self.tp, init_method=init_method_normal(0.02), sequence_parallel=sp, device=self.device
        )

    def megatron_layer(self, layer_class, *sizes, seed, sp, **options):
        """megatron-core's counterpart of a reference_layer, from the same seed."""
        torch.manual_seed(seed)
        return layer_class(
            *sizes,
            init_method=init_method_normal(0.02),
            config=self.megatron_config(sp),
            tp_group=mpu.get_tensor_model_parallel_group(),
            **options,
        ).to(self.device)

    def master_weight(self, vocab, seed):
        """What the unsharded model holds after the same seed: a [vocab, H] weight drawn by the init method."""
        torch.manual_seed(seed)
        master = torch.empty(vocab, H)
        init_method_normal(0.02)(master)
        return master.to(self.device)

    # ---- 1. VocabParallelEmbedding == torch.nn.Embedding from the same master weight ------------------------
    def check_embedding(self, vocab, sp, seed=3):
        what = f"embedding V={vocab} sp={sp}"
        emb = self.reference_layer(VocabParallelEmbedding, vocab, H, seed=seed, sp=sp)
        ref = torch.nn.Embedding.from_pretrained(self.master_weight(vocab, seed), freeze=False)
        padded = pad_vocab_size(vocab, self.world)
        assert emb.weight.shape == (padded // self.world, H) and emb.padded_vocab_size == padded
        weight_full = gather_dim(emb.weight.detach(), 0, self.tp)
        assert torch.equal(weight_full[:vocab], ref.weight.detach()), f"{what}: shards are not the master's rows"
        assert torch.count_nonzero(weight_full[vocab:]) == 0, f"{what}: padding rows should be zero"

        ids = self.token_ids(vocab, (B, S), seed + 1)
        expected = ref(ids)  # [b, s, h]
        weights = torch.randn(B, S, H, generator=gen(seed + 2)).to(self.device)
        (expected * weights).sum().backward()
        out = emb(ids)
        if sp:  # sequence-first, this rank's slice of the sequence
            expected = expected.transpose(0, 1).chunk(self.world, 0)[self.rank]
            weights = weights.transpose(0, 1).chunk(self.world, 0)[self.rank]
        assert_close(out, expected, f"{what}: output")
        (out * weights).sum().backward()
        grad_full = gather_dim(emb.weight.grad, 0, self.tp)
        assert_close(grad_full[:vocab], ref.weight.grad, f"{what}: weight grad")
        check_pad_rows(grad_full, vocab, what)

    # ---- 2. vocab_parallel_cross_entropy == F.cross_entropy on the full logits -----------------------------------
    def check_cross_entropy(self, vocab, scale, seed=5):
        what = f"cross_entropy V={vocab} scale={scale}"
        padded = pad_vocab_size(vocab, self.world)
        full = (scale * torch.randn(S, B, padded, generator=gen(seed))).to(self.device)
        full[..., vocab:] = 1e4  # padding columns with absurd logits: they must not move the loss
        target = self.token_ids(vocab, (S, B), seed + 1)
        upstream = torch.randn(S, B, generator=gen(seed + 2)).to(self.device)

        shard = full.chunk(self.world, -1)[self.rank].clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, target, self.tp, vocab_size=vocab)
        (loss * upstream).sum().backward()
        assert torch.equal(shard.detach(), full.chunk(self.world, -1)[self.rank]), (
            f"{what}: the input logits were modified"
        )

        real = full[..., :vocab].clone().requires_grad_()
        expected = F.cross_entropy(real.reshape(-1, vocab), target.reshape(-1), reduction="none").view(S, B)
        (expected * upstream).sum().backward()
        assert_close(loss, expected, f"{what}: loss")
        grad_full = gather_dim(shard.grad, -1, self.tp)
        assert_close(grad_full[..., :vocab], real.grad, f"{what}: grad wrt logits")
        check_pad_rows(grad_full.movedim(-1, 0), vocab, what)

    # ---- 3. LMHead (hidden -> loss) == unsharded Linear + cross_entropy: loss, dW, dhidden -------------
    def check_lm_head(self, vocab, sp, seed=7):
        what = f"lm_head V={vocab} sp={sp}"
        head = self.reference_layer(LMHead, H, vocab, seed=seed, sp=sp)
        weight = self.master_weight(vocab, seed).requires_grad_()
        hidden_full = torch.randn(S, B, H, generator=gen(seed + 1)).to(self.device).requires_grad_()
        labels = self.token_ids(vocab, (B, S), seed + 2)
        upstream = torch.randn(B, S, generator=gen(seed + 3)).to(self.device)

        logits = hidden_full @ weight.t()  # [s, b, V]
        expected = F.cross_entropy(logits.reshape(-1, vocab), labels.t().reshape(-1), reduction="none").view(S, B).t()
        (expected * upstream).sum().backward()

        hidden = hidden_full.detach().chunk(self.world, 0)[self.rank] if sp else hidden_full.detach()
        hidden = hidden.clone().requires_grad_()
        loss = head(hidden, labels)
        (loss * upstream).sum().backward()
        assert_close(loss, expected, f"{what}: loss")
        grad_w = gather_dim(head.weight.grad, 0, self.tp)
        assert_close(grad_w[:vocab], weight.grad, f"{what}: dW")
        check_pad_rows(grad_w, vocab, what)
        expected_dh = hidden_full.grad.chunk(self.world, 0)[self.rank] if sp else hidden_full.grad
        assert_close(hidden.grad, expected_dh, f"{what}: dhidden")

    def megatron_config(self, sp):
        return ModelParallelConfig(
            tensor_model_parallel_size=self.world,
            sequence_parallel=sp,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
        )

    def vs_megatron_cross_entropy(self, seed=11):
        full = torch.randn(S, B, self.v_even, generator=gen(seed)).to(self.device)
        target = self.token_ids(self.v_even, (S, B), seed + 1)
        results = []
        for fn in (
            lambda x: vocab_parallel_cross_entropy(x, target, self.tp),
            lambda x: megatron_tp.vocab_parallel_cross_entropy(x.clone(), target),
        ):  # megatron writes its input
            shard = full.chunk(self.world, -1)[self.rank].clone().requires_grad_()

            def step(fn=fn, shard=shard):
                loss = fn(shard)
                loss.sum().backward()
                return loss.detach()

            loss, events = record(step)
            results.append((loss, shard.grad, events))
        (mine, mine_grad, mine_events), (theirs, theirs_grad, theirs_events) = results
        assert_close(mine, theirs, "cross_entropy vs megatron: loss", atol=1e-6, rtol=1e-5)
        assert_close(mine_grad, theirs_grad, "cross_entropy vs megatron: grad", atol=1e-6, rtol=1e-5)
        compare_collectives("cross_entropy", mine_events, theirs_events)
        return mine_events

    def vs_megatron_embedding(self, sp, seed=13):
        what = f"embedding sp={sp} vs megatron"
        ids = self.token_ids(self.v_even, (B, S), seed + 1)
        weights = torch.randn(S, B, H, generator=gen(seed + 2)).to(self.device)
        weights = weights.chunk(self.world, 0)[self.rank] if sp else weights.transpose(0, 1)
        mine = self.reference_layer(VocabParallelEmbedding, self.v_even, H, seed=seed, sp=sp)
        theirs = self.megatron_layer(
            megatron_tp.VocabParallelEmbedding, self.v_even, H, seed=seed, sp=sp, reduce_scatter_embeddings=sp
        )
        assert torch.equal(mine.weight, theirs.weight), f"{what}: different shards from the same seed"
        assert (mine.vocab_start_index, mine.vocab_end_index) == (theirs.vocab_start_index, theirs.vocab_end_index)
        outs = []
        for module in (mine, theirs):

            def step(module=module):
                out = module(ids)
                (out * weights).sum().backward()
                return out.detach()

            outs.append(record(step))
        assert_close(outs[0][0], outs[1][0], f"{what}: output", atol=1e-6, rtol=1e-5)
        assert_close(mine.weight.grad, theirs.weight.grad, f"{what}: weight grad", atol=1e-6, rtol=1e-5)
        compare_collectives(what, outs[0][1], outs[1][1])
        return outs[0][1]

    def vs_megatron_lm_head(self, sp, seed=17):
        what = f"lm_head sp={sp} vs megatron"
        hidden_full = torch.randn(S, B, H, generator=gen(seed + 1)).to(self.device)
        hidden_in = hidden_full.chunk(self.world, 0)[self.rank] if sp else hidden_full
        labels = self.token_ids(self.v_even, (B, S), seed + 2)
        mine = self.reference_layer(LMHead, H, self.v_even, seed=seed, sp=sp)
        output_layer = self.megatron_layer(  # as GPTModel.output_layer with parallel_output=True
            megatron_tp.ColumnParallelLinear,
            H,
            self.v_even,
            seed=seed,
            sp=sp,
            bias=False,
            skip_bias_add=False,
            gather_output=False,
        )
        assert torch.equal(mine.weight, output_layer.weight), f"{what}: different shards"

        def theirs(hidden):  # LanguageModule.compute_language_model_loss, unfused path
            logits, _ = output_layer(hidden)
            loss = megatron_tp.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
            return loss.transpose(0, 1).contiguous()

        results = []
        for fn, weight in ((lambda h: mine(h, labels), mine.weight), (theirs, output_layer.weight)):
            hidden = hidden_in.clone().requires_grad_()

            def step(fn=fn, hidden=hidden):
                loss = fn(hidden)
                loss.sum().backward()
                return loss.detach()

            loss, events = record(step)
            results.append((loss, hidden.grad, weight.grad, events))
        for i, name in enumerate(["loss", "dhidden", "dW"]):
            assert_close(results[0][i], results[1][i], f"{what}: {name}", atol=1e-6, rtol=1e-5)
        compare_collectives(what, results[0][3], results[1][3])
        return results[0][3]

    def probe_lm_head(self, vocab, sp, seed=19):
        padded = pad_vocab_size(vocab, self.world)
        head = self.reference_layer(LMHead, H, vocab, seed=seed, sp=sp)
        hidden = torch.randn(S, B, H, generator=gen(seed + 1)).to(self.device)
        hidden = (hidden.chunk(self.world, 0)[self.rank] if sp else hidden).requires_grad_()
        labels = self.token_ids(vocab, (B, S), seed + 2)
        with AllocationProbe() as probe:
            head(hidden, labels).mean().backward()
        full_vocab = [item for item in probe.shapes if vocab in item[1] or padded in item[1]]
        assert not full_vocab, f"sp={sp}: a tensor with the full vocabulary as a dimension: {full_vocab[:3]}"
        op, shape = probe.largest()
        bound = S * B * padded // self.world
        assert torch.Size(shape).numel() <= bound, f"sp={sp}: largest tensor {op} {shape} > tokens * V_p / tp = {bound}"
        return len(probe.shapes), op, shape, bound

    def probe_unsharded(self, vocab, seed=19):
        """Negative control: the same probe over the unsharded head + loss does see full logits."""
        weight = self.master_weight(vocab, seed).requires_grad_()
        hidden = torch.randn(S, B, H, generator=gen(seed + 1)).to(self.device).requires_grad_()
        labels = self.token_ids(vocab, (B, S), seed + 2)
        with AllocationProbe() as probe:
            logits = hidden @ weight.t()
            F.cross_entropy(logits.reshape(-1, vocab), labels.t().reshape(-1)).backward()
        full_vocab = [item for item in probe.shapes if vocab in item[1]]
        assert full_vocab, "the probe should see full logits in the unsharded computation"
        op, shape = probe.largest()
        assert torch.Size(shape).numel() == S * B * vocab, (op, shape)
        return len(full_vocab), op, shape

    def unsharded(self) -> list[str]:
        """Sections 1-3 for each vocabulary; what was compared."""
        compared = []
        for vocab in [self.v_even, self.v_odd, V_TINY]:
            for sp in (False, True):
                self.check_embedding(vocab, sp)
                self.check_lm_head(vocab, sp)
                compared += [f"embedding V={vocab} sp={sp}", f"lm_head V={vocab} sp={sp}"]
            for scale in (1.0, 50.0):  # 50: logits far from 0, where a softmax without the max shift overflows
                self.check_cross_entropy(vocab, scale)
                compared.append(f"cross_entropy V={vocab} scale={scale}")
        return compared

    def megatron(self) -> dict[str, list]:
        """Section 4: the recorded collectives, (op, shape, phase), of each comparison with megatron."""
        events = {"cross_entropy": self.vs_megatron_cross_entropy()}
        for sp in (False, True):
            events[f"embedding sp={sp}"] = self.vs_megatron_embedding(sp)
            events[f"lm_head sp={sp}"] = self.vs_megatron_lm_head(sp)
        return {name: [[key[0], key[2], phase] for key, phase in seq] for name, seq in events.items()}

    def probes(self) -> dict:
        """Section 5: the largest tensor of the sharded head + loss, with and without SP, and of the unsharded."""
        found = {}
        for sp in (False, True):
            count, op, shape, bound = self.probe_lm_head(V_PROBE, sp)
            found[f"sp={sp}"] = {"tensors": count, "op": op, "largest": shape, "bound": bound}
        count, op, shape = self.probe_unsharded(V_PROBE)
        found["unsharded"] = {"full_vocabulary_tensors": count, "op": op, "largest": shape}
        return found

    def bad_input(self) -> list[str]:
        """Section 6: one clear error, on every TP rank alike (no hang); the messages."""
        head = self.reference_layer(LMHead, H, self.v_odd, seed=0)
        emb = self.reference_layer(VocabParallelEmbedding, self.v_odd, H, seed=0)
        hidden = torch.randn(S, B, H, device=self.device)
        good = self.token_ids(self.v_odd, (B, S), 1)
        messages = []
        for bad_id in (self.v_odd, pad_vocab_size(self.v_odd, self.world) - 1, -1):  # past, a pad id, negative
            bad = good.clone()
            bad[1, 3] = bad_id
            messages.append(
                expect_error(lambda bad=bad: head(hidden, bad), f"target holds id {bad_id}", f"[0, {self.v_odd})")
            )
            messages.append(expect_error(lambda bad=bad: emb(bad), f"input holds id {bad_id}"))
        shard = torch.randn(S, B, pad_vocab_size(self.v_odd, self.world) // self.world, device=self.device)
        messages.append(
            expect_error(lambda: vocab_parallel_cross_entropy(shard, good.t().float(), self.tp), "integer token ids")
        )
        messages.append(expect_error(lambda: vocab_parallel_cross_entropy(shard, good, self.tp), "does not match"))
        messages.append(
            expect_error(
                lambda: vocab_parallel_cross_entropy(shard, good.t(), self.tp, vocab_size=10**6), "padded vocabulary"
            )
        )
        loss = vocab_parallel_cross_entropy(shard.clone().requires_grad_(), good.t().contiguous(), self.tp, self.v_odd)
        loss.sum().backward(retain_graph=True)
        messages.append(expect_error(lambda: loss.sum().backward(), "twice", error=RuntimeError))
        return messages


@functools.cache
def results(device: torch.device) -> dict:
    """Every check at TP = world, computed once a rank (the numbers asserted on the way, naming the check and
    tensor): what was compared, the collectives, the allocation probe's figures, the bad-input messages."""
    if device.type == "cpu":
        cuda_calls_on_cpu()
    with megatron_parallel_state(tensor_model_parallel_size=dist.get_world_size()):
        checks = Checks(device)
        return {
            "unsharded": checks.unsharded(),
            "collectives": checks.megatron(),
            "probe": checks.probes(),
            "bad_input": checks.bad_input(),
        }


@on_ranks(2, 4, devices=DEVICES)
def test_vocab_parallel_matches_unsharded(ranks):
    world = ranks.world
    vocabs = [12 * world, 6 * world + 1, 5]  # divisible by TP, padded, and (TP=4) a rank holding only padding
    # equal numbers asserted in results(); this is what it compared
    assert results(ranks.device)["unsharded"] == [
        what
        for vocab in vocabs
        for what in (
            [f"{kind} V={vocab} sp={sp}" for sp in (False, True) for kind in ("embedding", "lm_head")]
            + [f"cross_entropy V={vocab} scale={scale}" for scale in (1.0, 50.0)]
        )
    ]


@on_ranks(2, 4, devices=DEVICES)
def test_vocab_parallel_matches_megatron_core(ranks):
    collectives = results(ranks.device)["collectives"]
    assert sorted(collectives) == [
        "cross_entropy",
        "embedding sp=False",
        "embedding sp=True",
        "lm_head sp=False",
        "lm_head sp=True",
    ]
    # the loss's three all-reduces of one fp32 number per token, forward only; nothing in backward
    assert collectives["cross_entropy"] == [["all_reduce", (S, B), "forward"]] * 3


@on_ranks(2, 4, devices=DEVICES)
def test_no_rank_allocates_full_logits(ranks):
    world, probes = ranks.world, results(ranks.device)["probe"]
    padded = pad_vocab_size(V_PROBE, world)
    for sp in (False, True):  # the largest tensor on every rank: one logits shard
        probe = probes[f"sp={sp}"]
        assert probe["largest"][-1] == padded // world, probe
        assert math.prod(probe["largest"]) == probe["bound"] == 16 * padded // world, probe
    assert probes["unsharded"]["full_vocabulary_tensors"] > 0
    assert probes["unsharded"]["largest"] == (16, V_PROBE)


@on_ranks(2, 4, devices=DEVICES)
def test_bad_input_raises_one_line_errors(ranks):
    mine = results(ranks.device)["bad_input"]  # each message checked in results(): one line, naming the problem
    assert len(mine) == 3 * 2 + 4
    everyone = every_rank(mine)
    assert all(messages == everyone[0] for messages in everyone), "ranks disagree"


@pytest.mark.parametrize(
    "vocab, tp, multiple, padded", [(50, 2, 1, 50), (50, 4, 1, 52), (5, 4, 1, 8), (50257, 8, 128, 51200), (1, 1, 1, 1)]
)
def test_pad_vocab_size(vocab, tp, multiple, padded):
    assert pad_vocab_size(vocab, tp, multiple) == padded


def test_pad_vocab_size_refuses_nonpositive_sizes():
    with pytest.raises(ParallelConfigError, match="must be positive"):
        pad_vocab_size(0, 2)
