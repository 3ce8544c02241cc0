"""Every CLI in reference/ and benchmarks/ shows one spelling per concept in its --help (Megatron-LM's where it
has one, the kit's short --tp/--pp/--dp), and still accepts the old spellings, hidden, with the same meaning."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reference import __main__ as demo_cli
from reference.measure.scale import __main__ as scale_cli

ROOT = Path(__file__).resolve().parents[2]

# Spellings of one concept; the first is the one to show. A CLI's help may show at most one of each row, and
# all CLIs together too.
SYNONYMS = [
    ("--micro-batches", "--microbatches", "--num-micro-batches", "--num-microbatches"),
    ("--micro-batch-size", "--batch-size", "--mbs"),
    ("--global-batch-size", "--gbs"),
    ("--sequence-parallel", "--sp"),
    ("--dp-sharding", "--distributed-optimizer", "--use-distributed-optimizer"),
    ("--tp", "--tensor-parallel", "--tensor-model-parallel-size", "--tp-size"),
    ("--pp", "--pipeline-parallel", "--pipeline-model-parallel-size", "--pp-size"),
    ("--dp", "--data-parallel", "--data-parallel-size", "--dp-size"),
    ("--ep", "--expert-parallel", "--expert-model-parallel-size", "--ep-size"),
    ("--virtual-stages", "--virtual-pipeline-model-parallel-size", "--num-virtual-stages"),
    ("--num-kv-heads", "--num-query-groups"),
    ("--seq-length", "--seq-len", "--sequence-length"),
    ("--num-layers", "--layers"),
    ("--rounds", "--repeat"),
]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


def cli_scripts() -> list[Path]:
    """Every file that builds an argument parser and runs as a program: a new CLI is covered without a list."""
    files = [*(ROOT / "reference").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]
    return sorted(
        path
        for path in files
        if re.search(r"(ArgumentParser|OneLineParser)\(", text := path.read_text()) and "__main__" in text
    )


# Runs each CLI's main with --help in one child process: importing a benchmark has side effects on the process
# (bench_tp redirects torch.cuda calls to the CPU) that must not reach the other tests.
HELP_ALL = """
import contextlib, io, json, runpy, sys
out = {}
for path in sys.argv[1:]:
    sys.argv, buffer = [path, "--help"], io.StringIO()
    with contextlib.redirect_stdout(buffer):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit_:
            assert exit_.code in (0, None), (path, exit_.code)
    out[path] = buffer.getvalue()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, str]:
    """Each CLI's --help, as printed by running it (no line wrapping, so no flag is split at a hyphen)."""
    paths = [str(path.relative_to(ROOT)) for path in cli_scripts()]
    env = {**os.environ, "COLUMNS": "10000", "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'benchmarks'}"}
    done = subprocess.run(
        [sys.executable, "-c", HELP_ALL, *paths], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_clis_are_found(helps):
    assert {"reference/__main__.py", "reference/layout.py", "reference/measure/scale/__main__.py"} <= set(helps)
    assert {"benchmarks/bench_pipeline.py", "benchmarks/bench_tp.py", "benchmarks/bench_fsdp.py"} <= set(helps)


def test_one_visible_spelling_per_concept(helps):
    shown = {cli: set(FLAG.findall(text)) for cli, text in helps.items()}
    clashes = []
    for row in SYNONYMS:
        used = {spelling: sorted(cli for cli, flags in shown.items() if spelling in flags) for spelling in row}
        used = {spelling: clis for spelling, clis in used.items() if clis}
        if len(used) > 1 or (used and row[0] not in used):
            clashes.append(f"{row[0]}: shown as {used}")
    assert not clashes, "\n".join(clashes)


def scale_args(*argv: str):
    return scale_cli.build_parser().parse_args(["--model", "small", *argv])


def test_old_spellings_still_parse_to_the_same_setup():
    assert (
        scale_args("--microbatches", "4", "--sp").__dict__
        == scale_args("--micro-batches", "4", "--sequence-parallel").__dict__
    )
    assert scale_args("--distributed-optimizer").__dict__ == scale_args("--dp-sharding", "optimizer").__dict__
    assert scale_args().dp_sharding == "replicate" and scale_args().micro_batches == 16
    demo = demo_cli.build_parser()
    assert demo.parse_args(["--batch-size", "3"]) == demo.parse_args(["--micro-batch-size", "3"])
    assert demo.parse_args([]).batch_size == 2


def test_old_spellings_are_hidden_from_help():
    text = scale_cli.build_parser().format_help()
    assert "--microbatches" not in text and "--distributed-optimizer" not in text
    assert not re.search(r"--sp\b", text)
