"""`torchrun --nproc-per-node 4 -m reference --model llama --tp 2 --dp 2 --dp-sharding fsdp --sequence-parallel`:
the Llama/Qwen2 block in the demo. One-line refusals of sizes it cannot split, and one world-4 run whose loss
is the unsharded llama model's, with its traffic per group and every rank's memory."""

import pytest

from reference.__main__ import main
from reference.gpt.model import GPTConfig
from tests.launch import torchrun
from tests.reference.helpers import json_lines, unsharded_gpt_training
from tests.reference.refusals import refusal

# s = 7: TP 2 does not divide it, so sequence parallelism pads it to 8 and continues the rotary positions
MODEL = dict(vocab_size=50, hidden_size=32, num_attention_heads=4, num_layers=2, seq_length=7)
B, STEPS, SEED, LR = 2, 3, 7, 0.5
KV_REFUSED = (
    "2 key/value heads cannot be split over tensor-parallel size 4: each rank needs a whole key/value "
    "head (Megatron replicates them instead; this reference does not), lower --tp"
)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "llama", "--tp", "3"], "num_attention_heads (4) is not divisible by the tensor-parallel size (3)"),
        (["--model", "llama", "--tp", "4"], KV_REFUSED),
        (
            [
                "--model",
                "llama",
                "--tp",
                "2",
                "--num-attention-heads",
                "6",
                "--hidden-size",
                "48",
                "--num-kv-heads",
                "3",
            ],
            "num_kv_heads (key/value heads) (3) is not divisible by the tensor-parallel size (2)",
        ),
        (
            ["--model", "llama", "--tp", "2", "--num-kv-heads", "3"],
            "4 attention heads do not split into 3 key/value heads' groups of equal size",
        ),
        (
            [
                "--model",
                "llama",
                "--tp",
                "4",
                "--num-attention-heads",
                "8",
                "--num-kv-heads",
                "4",
                "--seq-length",
                "2",
                "--sequence-parallel",
            ],
            "sequence length 2 is shorter than the tensor-parallel size 4: sequence parallelism would leave a rank "
            "without tokens",
        ),
        (["--num-kv-heads", "2"], "--num-kv-heads 2: needs --model llama and a positive count"),
    ],
)
def test_sizes_the_llama_block_cannot_split_are_refused_in_one_line(args, message, capsys):
    stderr = refusal(main, args, capsys)
    assert stderr.strip() == f"reference: error: {message}", stderr


def test_an_unknown_model_name_is_refused_in_one_line(capsys):
    stderr = refusal(main, ["--model", "qwen"], capsys)
    assert stderr.count("\n") == 1
    assert "argument --model: invalid choice: 'qwen' (choose from 'gpt2', 'llama')" in stderr


def unsharded_losses() -> list[float]:
    config = GPTConfig(**MODEL, style="llama", num_kv_heads=2)
    return unsharded_gpt_training(config, SEED, STEPS, LR, B * 2).losses


def test_llama_fsdp_tp_sp_demo_trains_like_the_unsharded_model_and_reports_traffic_and_memory():
    """The real `torchrun -m reference` command end to end (the other demo tests share @on_ranks launches)."""
    args = [
        "--model",
        "llama",
        "--tp",
        "2",
        "--dp",
        "2",
        "--dp-sharding",
        "fsdp",
        "--sequence-parallel",
        "--json",
        "--steps",
        str(STEPS),
        "--batch-size",
        str(B),
        "--seed",
        str(SEED),
        "--lr",
        str(LR),
        "--vocab-size",
        "50",
        "--hidden-size",
        "32",
        "--seq-length",
        "7",
        "--num-layers",
        "2",
    ]
    lines = json_lines(torchrun("-m", 4, "reference", *args, timeout=240))
    steps = [x for x in lines if "step" in x]
    assert [s["loss"] for s in steps] == pytest.approx(unsharded_losses(), abs=1e-5)
    groups = steps[-1]["collectives"]
    assert set(groups["tp"]) == {"all_reduce", "all_gather", "reduce_scatter"}  # SP: gathers and scatters
    assert set(groups["dp"]) == {"all_gather", "reduce_scatter"}  # FSDP over DP
    memory = next(x for x in lines if "memory" in x)["memory"]
    assert [m["rank"] for m in memory] == [0, 1, 2, 3]
    unsharded = steps[-1]["param_bytes_unsharded"]
    for m in memory:  # each rank holds about 1/(tp x dp) of the parameters (FSDP pads its flat shards)
        assert unsharded / 4 <= m["param_bytes"] < unsharded / 4 * 1.05 and m["peak_activation_bytes"] > 0
