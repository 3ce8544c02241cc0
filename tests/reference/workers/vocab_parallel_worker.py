"""Vocab-parallel embedding and loss parallelism at TP = world, against the unsharded computation, against
megatron-core 0.16.1, with an allocation probe proving no rank materializes full logits, and bad input.

Prints one marker line per group of checks and, on rank 0, the measured figures ("figures: ..." lines) that
test_vocab_parallel.py reads. megatron-core runs on CPU/gloo (use_cpu_initialization=True); its
sequence-parallel paths allocate on torch.cuda.current_device(), redirected to the CPU here.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common import assert_close, finish, gather_dim, init
from reference.torch_patches import cuda_calls_on_cpu

device = init()
if device.type == "cpu":
    cuda_calls_on_cpu()

from megatron.core import parallel_state as mpu  # noqa: E402
from megatron.core import tensor_parallel as megatron_tp  # noqa: E402
from megatron.core.model_parallel_config import ModelParallelConfig  # noqa: E402

from reference.parallel_state import ParallelConfigError, build_layout  # noqa: E402
from reference.recorder import CollectiveRecorder  # noqa: E402
from reference.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy  # noqa: E402
from reference.tensor_parallel.unsharded import init_method_normal  # noqa: E402
from reference.tensor_parallel.vocab_parallel import (  # noqa: E402
    ParallelLMHead,
    VocabParallelEmbedding,
    pad_vocab_size,
)

world, rank = dist.get_world_size(), dist.get_rank()
mpu.initialize_model_parallel(tensor_model_parallel_size=world, create_gloo_process_groups=False)
tp = build_layout(tp_size=world).tp_group
S, B, H = 8, 2, 8                  # 16 tokens; H < tokens so a logits shard is the largest tensor of the head
V_EVEN = 12 * world                # divisible by TP
V_ODD = 6 * world + 1              # padded to 7 * world
V_TINY = 5                         # at TP=4 padded to 8: the last rank holds only padding
VOCABS = [V_EVEN, V_ODD, V_TINY]
max_diff = {"embedding": 0.0, "cross_entropy": 0.0, "lm_head": 0.0, "megatron": 0.0}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def track(kind, actual, expected, what, **tol):
    assert_close(actual, expected, what, **tol)
    max_diff[kind] = max(max_diff[kind], (actual.detach() - expected.detach()).abs().max().item())


def token_ids(vocab, shape, seed):
    ids = torch.randint(vocab, shape, generator=gen(seed))
    ids.view(-1)[:2] = torch.tensor([0, vocab - 1])  # both ends of the vocabulary, every time
    return ids.to(device)


def master_weight(vocab, seed):
    """What the unsharded model holds after the same seed: a [vocab, H] weight drawn by the init method."""
    torch.manual_seed(seed)
    master = torch.empty(vocab, H)
    init_method_normal(0.02)(master)
    return master.to(device)


def check_pad_rows(grad_full, vocab, what):
    assert torch.count_nonzero(grad_full[vocab:]) == 0, f"{what}: padding rows/columns got a non-zero gradient"


# ---- 1. VocabParallelEmbedding == torch.nn.Embedding from the same master weight ------------------------
def check_embedding(vocab, sp, seed=3):
    what = f"embedding V={vocab} sp={sp}"
    torch.manual_seed(seed)
    emb = VocabParallelEmbedding(vocab, H, tp_group=tp, init_method=init_method_normal(0.02), sequence_parallel=sp,
                                 device=device)
    ref = torch.nn.Embedding.from_pretrained(master_weight(vocab, seed), freeze=False)
    padded = pad_vocab_size(vocab, world)
    assert emb.weight.shape == (padded // world, H) and emb.padded_vocab_size == padded
    weight_full = gather_dim(emb.weight.detach(), 0, tp)
    assert torch.equal(weight_full[:vocab], ref.weight.detach()), f"{what}: shards are not the master's rows"
    assert torch.count_nonzero(weight_full[vocab:]) == 0, f"{what}: padding rows should be zero"

    ids = token_ids(vocab, (B, S), seed + 1)
    expected = ref(ids)                                    # [b, s, h]
    weights = torch.randn(B, S, H, generator=gen(seed + 2)).to(device)
    (expected * weights).sum().backward()
    out = emb(ids)
    if sp:  # sequence-first, this rank's slice of the sequence
        expected = expected.transpose(0, 1).chunk(world, 0)[rank]
        weights = weights.transpose(0, 1).chunk(world, 0)[rank]
    track("embedding", out, expected, f"{what}: output")
    (out * weights).sum().backward()
    grad_full = gather_dim(emb.weight.grad, 0, tp)
    track("embedding", grad_full[:vocab], ref.weight.grad, f"{what}: weight grad")
    check_pad_rows(grad_full, vocab, what)


# ---- 2. vocab_parallel_cross_entropy == F.cross_entropy on the full logits -----------------------------------
def check_cross_entropy(vocab, scale, seed=5):
    what = f"cross_entropy V={vocab} scale={scale}"
    padded = pad_vocab_size(vocab, world)
    full = (scale * torch.randn(S, B, padded, generator=gen(seed))).to(device)
    full[..., vocab:] = 1e4  # padding columns with absurd logits: they must not move the loss
    target = token_ids(vocab, (S, B), seed + 1)
    upstream = torch.randn(S, B, generator=gen(seed + 2)).to(device)

    shard = full.chunk(world, -1)[rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, tp, vocab_size=vocab)
    (loss * upstream).sum().backward()
    assert torch.equal(shard.detach(), full.chunk(world, -1)[rank]), f"{what}: the input logits were modified"

    real = full[..., :vocab].clone().requires_grad_()
    expected = F.cross_entropy(real.reshape(-1, vocab), target.reshape(-1), reduction="none").view(S, B)
    (expected * upstream).sum().backward()
    track("cross_entropy", loss, expected, f"{what}: loss")
    grad_full = gather_dim(shard.grad, -1, tp)
    track("cross_entropy", grad_full[..., :vocab], real.grad, f"{what}: grad wrt logits")
    check_pad_rows(grad_full.movedim(-1, 0), vocab, what)


# ---- 3. ParallelLMHead (hidden -> loss) == unsharded Linear + cross_entropy: loss, dW, dhidden -------------
def check_lm_head(vocab, sp, seed=7):
    what = f"lm_head V={vocab} sp={sp}"
    torch.manual_seed(seed)
    head = ParallelLMHead(H, vocab, tp_group=tp, init_method=init_method_normal(0.02), sequence_parallel=sp,
                          device=device)
    weight = master_weight(vocab, seed).requires_grad_()
    hidden_full = torch.randn(S, B, H, generator=gen(seed + 1)).to(device).requires_grad_()
    labels = token_ids(vocab, (B, S), seed + 2)
    upstream = torch.randn(B, S, generator=gen(seed + 3)).to(device)

    logits = hidden_full @ weight.t()  # [s, b, V]
    expected = F.cross_entropy(logits.reshape(-1, vocab), labels.t().reshape(-1), reduction="none").view(S, B).t()
    (expected * upstream).sum().backward()

    hidden = hidden_full.detach().chunk(world, 0)[rank] if sp else hidden_full.detach()
    hidden = hidden.clone().requires_grad_()
    loss = head(hidden, labels)
    (loss * upstream).sum().backward()
    track("lm_head", loss, expected, f"{what}: loss")
    grad_w = gather_dim(head.output_layer.weight.grad, 0, tp)
    track("lm_head", grad_w[:vocab], weight.grad, f"{what}: dW")
    check_pad_rows(grad_w, vocab, what)
    expected_dh = hidden_full.grad.chunk(world, 0)[rank] if sp else hidden_full.grad
    track("lm_head", hidden.grad, expected_dh, f"{what}: dhidden")


for vocab in VOCABS:
    for sp in (False, True):
        check_embedding(vocab, sp)
        check_lm_head(vocab, sp)
    for scale in (1.0, 50.0):  # 50: logits far from 0, where a softmax without the max shift overflows
        check_cross_entropy(vocab, scale)
print(f"rank {rank}: vocab parallel vs unsharded ok", flush=True)


# ---- 4. against megatron-core: same numbers, same recorded collectives ------------------------------------------
def record(fn):
    with CollectiveRecorder() as rec:
        result = fn()
    return result, [(e.key(), e.phase) for e in rec.events]


def megatron_config(sp):
    return ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=sp, use_cpu_initialization=True,
                               params_dtype=torch.float32)


def compare_collectives(what, mine, theirs):
    assert mine == theirs, f"{what}: collectives differ\nreference {mine}\nmegatron  {theirs}"
    assert mine, f"{what}: no collective recorded"


def vs_megatron_cross_entropy(seed=11):
    full = torch.randn(S, B, V_EVEN, generator=gen(seed)).to(device)
    target = token_ids(V_EVEN, (S, B), seed + 1)
    results = []
    for fn in (lambda x: vocab_parallel_cross_entropy(x, target, tp),
               lambda x: megatron_tp.vocab_parallel_cross_entropy(x.clone(), target)):  # megatron writes its input
        shard = full.chunk(world, -1)[rank].clone().requires_grad_()

        def step(fn=fn, shard=shard):
            loss = fn(shard)
            loss.sum().backward()
            return loss.detach()
        loss, events = record(step)
        results.append((loss, shard.grad, events))
    (mine, mine_grad, mine_events), (theirs, theirs_grad, theirs_events) = results
    track("megatron", mine, theirs, "cross_entropy vs megatron: loss", atol=1e-6, rtol=1e-5)
    track("megatron", mine_grad, theirs_grad, "cross_entropy vs megatron: grad", atol=1e-6, rtol=1e-5)
    compare_collectives("cross_entropy", mine_events, theirs_events)
    return mine_events


def vs_megatron_embedding(sp, seed=13):
    what = f"embedding sp={sp} vs megatron"
    ids = token_ids(V_EVEN, (B, S), seed + 1)
    weights = torch.randn(S, B, H, generator=gen(seed + 2)).to(device)
    weights = weights.chunk(world, 0)[rank] if sp else weights.transpose(0, 1)
    torch.manual_seed(seed)
    mine = VocabParallelEmbedding(V_EVEN, H, tp_group=tp, init_method=init_method_normal(0.02), sequence_parallel=sp,
                                  device=device)
    torch.manual_seed(seed)
    theirs = megatron_tp.VocabParallelEmbedding(V_EVEN, H, init_method=init_method_normal(0.02),
                                                reduce_scatter_embeddings=sp, config=megatron_config(sp),
                                                tp_group=mpu.get_tensor_model_parallel_group()).to(device)
    assert torch.equal(mine.weight, theirs.weight), f"{what}: different shards from the same seed"
    assert (mine.vocab_start_index, mine.vocab_end_index) == (theirs.vocab_start_index, theirs.vocab_end_index)
    outs = []
    for module in (mine, theirs):
        def step(module=module):
            out = module(ids)
            (out * weights).sum().backward()
            return out.detach()
        outs.append(record(step))
    track("megatron", outs[0][0], outs[1][0], f"{what}: output", atol=1e-6, rtol=1e-5)
    track("megatron", mine.weight.grad, theirs.weight.grad, f"{what}: weight grad", atol=1e-6, rtol=1e-5)
    compare_collectives(what, outs[0][1], outs[1][1])
    return outs[0][1]


def vs_megatron_lm_head(sp, seed=17):
    what = f"lm_head sp={sp} vs megatron"
    hidden_full = torch.randn(S, B, H, generator=gen(seed + 1)).to(device)
    hidden_in = hidden_full.chunk(world, 0)[rank] if sp else hidden_full
    labels = token_ids(V_EVEN, (B, S), seed + 2)
    torch.manual_seed(seed)
    mine = ParallelLMHead(H, V_EVEN, tp_group=tp, init_method=init_method_normal(0.02), sequence_parallel=sp,
                          device=device)
    torch.manual_seed(seed)
    output_layer = megatron_tp.ColumnParallelLinear(  # as GPTModel.output_layer with parallel_output=True
        H, V_EVEN, config=megatron_config(sp), init_method=init_method_normal(0.02), bias=False,
        skip_bias_add=False, gather_output=False, tp_group=mpu.get_tensor_model_parallel_group()).to(device)
    assert torch.equal(mine.output_layer.weight, output_layer.weight), f"{what}: different shards"

    def theirs(hidden):  # LanguageModule.compute_language_model_loss, unfused path
        logits, _ = output_layer(hidden)
        loss = megatron_tp.vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous())
        return loss.transpose(0, 1).contiguous()

    results = []
    for fn, weight in ((lambda h: mine(h, labels), mine.output_layer.weight), (theirs, output_layer.weight)):
        hidden = hidden_in.clone().requires_grad_()

        def step(fn=fn, hidden=hidden):
            loss = fn(hidden)
            loss.sum().backward()
            return loss.detach()
        loss, events = record(step)
        results.append((loss, hidden.grad, weight.grad, events))
    for i, name in enumerate(["loss", "dhidden", "dW"]):
        track("megatron", results[0][i], results[1][i], f"{what}: {name}", atol=1e-6, rtol=1e-5)
    compare_collectives(what, results[0][3], results[1][3])
    return results[0][3]


events = {"cross_entropy": vs_megatron_cross_entropy()}
for sp in (False, True):
    events[f"embedding sp={sp}"] = vs_megatron_embedding(sp)
    events[f"lm_head sp={sp}"] = vs_megatron_lm_head(sp)
if rank == 0:
    for name, seq in events.items():
        print(f"figures: collectives {name}: {[(key[0], key[2], phase) for key, phase in seq]}", flush=True)
print(f"rank {rank}: megatron comparisons ok", flush=True)


# ---- 5. no rank ever allocates full logits (measured) --------------------------------------------------------
class AllocationProbe(TorchDispatchMode):
    """Records the shape of every tensor any op produces (forward and backward, collectives included)."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.shapes += [(str(func.overloadpacket), tuple(t.shape)) for t in tree_leaves(out)
                        if isinstance(t, torch.Tensor)]
        return out

    def largest(self):
        return max(self.shapes, key=lambda item: torch.Size(item[1]).numel())


def probe_lm_head(vocab, sp, seed=19):
    padded = pad_vocab_size(vocab, world)
    torch.manual_seed(seed)
    head = ParallelLMHead(H, vocab, tp_group=tp, init_method=init_method_normal(0.02), sequence_parallel=sp,
                          device=device)
    hidden = torch.randn(S, B, H, generator=gen(seed + 1)).to(device)
    hidden = (hidden.chunk(world, 0)[rank] if sp else hidden).requires_grad_()
    labels = token_ids(vocab, (B, S), seed + 2)
    with AllocationProbe() as probe:
        head(hidden, labels).mean().backward()
    full_vocab = [item for item in probe.shapes if vocab in item[1] or padded in item[1]]
    assert not full_vocab, f"sp={sp}: a tensor with the full vocabulary as a dimension: {full_vocab[:3]}"
    op, shape = probe.largest()
    bound = S * B * padded // world
    assert torch.Size(shape).numel() <= bound, f"sp={sp}: largest tensor {op} {shape} > tokens * V_p / tp = {bound}"
    return len(probe.shapes), op, shape, bound


def probe_unsharded(vocab, seed=19):
    """Negative control: the same probe over the unsharded head + loss does see full logits."""
    weight = master_weight(vocab, seed).requires_grad_()
    hidden = torch.randn(S, B, H, generator=gen(seed + 1)).to(device).requires_grad_()
    labels = token_ids(vocab, (B, S), seed + 2)
    with AllocationProbe() as probe:
        logits = hidden @ weight.t()
        F.cross_entropy(logits.reshape(-1, vocab), labels.t().reshape(-1)).backward()
    full_vocab = [item for item in probe.shapes if vocab in item[1]]
    assert full_vocab, "the probe should see full logits in the unsharded computation"
    op, shape = probe.largest()
    assert torch.Size(shape).numel() == S * B * vocab, (op, shape)
    return len(full_vocab), op, shape


V_PROBE = 50  # no dimension of the test collides with 50 or its padded size / shards (52, 25, 13)
for sp in (False, True):
    count, op, shape, bound = probe_lm_head(V_PROBE, sp)
    line = (f"figures: probe tp={world} sp={sp} V={V_PROBE} V_p={pad_vocab_size(V_PROBE, world)}: rank {rank} "
            f"{count} tensors, none with a full-vocabulary dimension, largest {shape} from {op} "
            f"({torch.Size(shape).numel()} elements <= tokens*V_p/tp = {bound})")
    print(line, flush=True)
count, op, shape = probe_unsharded(V_PROBE)
if rank == 0:
    print(f"figures: probe unsharded V={V_PROBE}: {count} tensors with the full vocabulary as a dimension, "
          f"largest {shape} from {op} ({torch.Size(shape).numel()} elements)", flush=True)
print(f"rank {rank}: allocation probe ok", flush=True)


# ---- 6. bad input: one clear error, on every TP rank alike (no hang) ----------------------------------------------
def expect_error(fn, *needles, error=ParallelConfigError):
    try:
        fn()
    except error as exc:
        message = str(exc)
        assert "\n" not in message and all(n in message for n in needles), message
        return message
    raise AssertionError(f"expected {error.__name__} mentioning {needles}")


torch.manual_seed(0)
head = ParallelLMHead(H, V_ODD, tp_group=tp, init_method=init_method_normal(0.02), device=device)
emb = VocabParallelEmbedding(V_ODD, H, tp_group=tp, init_method=init_method_normal(0.02), device=device)
hidden = torch.randn(S, B, H, device=device)
good = token_ids(V_ODD, (B, S), 1)
for bad_id in (V_ODD, pad_vocab_size(V_ODD, world) - 1, -1):  # past the vocabulary, a pad id, negative
    bad = good.clone()
    bad[1, 3] = bad_id
    expect_error(lambda: head(hidden, bad), f"target holds id {bad_id}", f"[0, {V_ODD})")
    expect_error(lambda: emb(bad), f"input holds id {bad_id}")
shard = torch.randn(S, B, pad_vocab_size(V_ODD, world) // world, device=device)
expect_error(lambda: vocab_parallel_cross_entropy(shard, good.t().float(), tp), "integer token ids")
expect_error(lambda: vocab_parallel_cross_entropy(shard, good, tp), "does not match")
expect_error(lambda: vocab_parallel_cross_entropy(shard, good.t(), tp, vocab_size=10 ** 6), "padded vocabulary")
loss = vocab_parallel_cross_entropy(shard.clone().requires_grad_(), good.t().contiguous(), tp, V_ODD)
loss.sum().backward(retain_graph=True)
expect_error(lambda: loss.sum().backward(), "twice", error=RuntimeError)
print(f"rank {rank}: bad input ok", flush=True)

if rank == 0:
    print("figures: max abs difference " + ", ".join(f"{k} {v:.2e}" for k, v in max_diff.items()), flush=True)
mpu.destroy_model_parallel()
finish()
