"""`tools/record-traces [--out DIR] [--only NAME ...]`: re-record the runs the study site's diagrams and numbers
come from.

Each recording writes DIR/NAME.json (default reading_notes/traces/, committed), and a test traces the same runs
afresh and fails when they no longer match, so re-record after changing the reference and commit the result:
WORKER_RUNS, tools/trace_worker.py under torchrun on two and four ranks (tests/evidence/test_trace_freshness.py);
SCALE and MOE_SCALE, `python -m reference.measure.scale --json` on a fake process group, a process each
(tests/reference/test_scale.py, test_moe_scale.py); layout_grid, `python -m reference.measure.scale.grid` (the
Scale page's calculator; test_scale_grid.py); PRINTED, what the activation-memory benchmark, the DTensor and MoE
demos and reference.measure.cp_blocks print with --json (test_activation_memory.py, test_hf_tp_demo.py,
test_moe_demo.py, tests/evidence/test_cp_blocks_freshness.py); and tools/fsdp_compare.py on four ranks
(tests/evidence/test_fsdp1_vs_fsdp2.py). `--only NAME ...` runs just the recordings that make those traces and
writes just them, leaving the others as they are. Exit status: 0 recorded, 1 a run failed (its output is
printed), 2 a usage error (an unknown trace name).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pin_and_cite.core.atomic import atomic_write

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "tools" / "trace_worker.py"
RANKS = 2
PIPELINE_RANKS = 4  # trace_worker.PIPELINE_RANKS
# each trace_worker.py launch: ranks, its `what` argument, and the traces it writes
WORKER_RUNS = (
    (RANKS, "tp_fsdp", ("tp_block", "tp_block_llama", "fsdp_forward", "fsdp2_forward")),
    (
        PIPELINE_RANKS,
        "pipeline",
        (
            *("pipeline_gpipe", "pipeline_1f1b", "pipeline_interleaved"),
            *("pipeline_zb_h1", "pipeline_zbv", "pipeline_dualpipev"),
        ),
    ),
)
# trace name -> python -m reference.measure.scale arguments: the GPT block at 70B's sizes (gpt-70b-shape) on TP 8 x
# PP 8 x DP 64 (1F1B, DDP in 25 MiB buckets),
# plain TP, with sequence parallelism, and with the distributed optimizer; then the same 4,096 ranks as TP 8 x DP 512
# without pipelining (the reference FSDP2 takes one micro-batch), FSDP2 over DP and HSDP (8 replicas of 64); and
# Llama-3-70B (llama3-70b) on the first layout
SCALE_70B = ["--model", "gpt-70b-shape", "--tp", "8", "--pp", "8", "--dp", "64", "--micro-batches", "16"]
SCALE_70B_FSDP2 = ["--model", "gpt-70b-shape", "--tp", "8", "--pp", "1", "--dp", "512", "--micro-batches", "1"]
SCALE = {
    "scale_70b": SCALE_70B,
    "scale_70b_sp": [*SCALE_70B, "--sequence-parallel"],
    "scale_70b_distopt": [*SCALE_70B, "--dp-sharding", "optimizer"],
    "scale_70b_fsdp2": [*SCALE_70B_FSDP2, "--dp-sharding", "fsdp2"],
    "scale_70b_hsdp": [*SCALE_70B_FSDP2, "--dp-sharding", "fsdp2", "--dp-replicate", "8"],
    "scale_llama3_70b": ["--model", "llama3-70b", *SCALE_70B[2:]],  # the model people train, same layout
}
# trace name -> python -m reference.measure.scale arguments of a MoE model's MoE layers, at Zipf routing skew 0.5:
# Mixtral-8x7B-like with expert TP, and a DeepSeek-V3-like 256-expert layer without TP
MOE_SKEW = ["--order", "tp-dp-pp", "--micro-batches", "16", "--routing-skew", "0.5"]
MOE_SCALE = {
    "moe_scale_mixtral_8x7b": "--model mixtral-8x7b --tp 2 --pp 4 --dp 16 --ep 8".split() + MOE_SKEW,
    "moe_scale_deepseek_v3": "--model deepseek-v3-moe --tp 1 --pp 8 --dp 128 --ep 64".split() + MOE_SKEW,
}


def _run(cmd: list[str], what: str, timeout: float, **env: str) -> str:
    """Run one recording process from the repository root, single-threaded; its stdout, or RuntimeError
    with the tail of its output. A line on stderr as it starts and as it ends, with its time: a whole
    re-recording takes minutes."""
    print(f"record-traces: {what} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    proc = subprocess.run(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{what} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}")
    print(f"record-traces: {what}: done in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return proc.stdout


def _torchrun(ranks: int, script: Path | str, *args: str, what: str, timeout: float) -> str:
    """_run of `script` (or "-m", a module) on `ranks` local ranks under torchrun (CPU, gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    return _run([*cmd, "--max-restarts=0", str(script), *args], what, timeout, TORCH_CPP_LOG_LEVEL="ERROR")


def _write(out: Path, traces: dict[str, str]) -> list[Path]:
    """Write out/NAME.json for each trace (name -> its JSON text); the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    for name, text in traces.items():
        atomic_write(out / f"{name}.json", text.encode())
    return [out / f"{name}.json" for name in traces]


def record(
    out: Path, timeout: float = 300, only: Collection[str] | None = None, script: Path = WORKER, runs=WORKER_RUNS
) -> list[Path]:
    """Run `script` once per entry of `runs` (ranks, its argument or None, the traces it writes) into a scratch
    folder, then move each trace (each of `only`) into `out`; the paths written."""
    with tempfile.TemporaryDirectory(prefix="traces-") as scratch:
        for ranks, what, names in runs:
            if only is not None and not set(names) & set(only):
                continue
            args = [what] if what else []
            label = f"{script.stem.replace('_', ' ')} ({', '.join([*args, f'{ranks} ranks'])})"
            _torchrun(ranks, script, scratch, *args, what=label, timeout=timeout)
        out.mkdir(parents=True, exist_ok=True)
        written = []
        for trace in sorted(Path(scratch).glob("*.json")):
            if only is not None and trace.stem not in only:
                continue
            shutil.move(str(trace), out / trace.name)  # within one filesystem: a rename
            written.append(out / trace.name)
        return written


def record_scale(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Write out/NAME.json for every scale trace in SCALE and MOE_SCALE (each of `only`); the paths written. The
    layouts are traced side by side, a single-threaded process each, so every core works."""
    layouts = {**SCALE, **MOE_SCALE}
    names = [name for name in layouts if only is None or name in only]

    def trace(name: str) -> str:
        args = layouts[name]
        return _run(
            [sys.executable, "-m", "reference.measure.scale", *args, "--json"],
            f"reference.measure.scale {' '.join(args)}",
            timeout,
            PYTHONWARNINGS="ignore",
        )

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        traced = list(pool.map(trace, names))  # all finish (or fail) before anything is written
    return _write(out, dict(zip(names, traced)))


def record_layout_grid(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Write out/layout_grid.json, the formulas over the calculator's layouts (unless `only` leaves it out)."""
    if only is not None and "layout_grid" not in only:
        return []
    stdout = _run([sys.executable, "-m", "reference.measure.scale.grid"], "reference.measure.scale.grid", timeout)
    return _write(out, {"layout_grid": stdout})


ACTIVATION_MEMORY = [  # tests/reference/test_activation_memory.py's COUNT_SHAPE and LLAMA_COUNT_SHAPE
    *("--seq-length", "32", "--batch-size", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--num-kv-heads", "2", "--ffn-hidden-size", "160"),
    *("--device", "cpu"),  # the committed counts are the CPU's (a GPU's SDPA kernels save other tensors)
]
# trace name -> `torchrun --nproc-per-node 2 -m reference.hf_tp --json` arguments: PyTorch DTensor's plan on HF's
# Qwen2ForCausalLM, without and with sequence parallelism (the DTensor walkthrough's worked example)
DTENSOR = {"dtensor_qwen2": [], "dtensor_qwen2_sp": ["--sequence-parallel"]}
# trace name -> (ranks, `torchrun -m reference --moe ... --json` arguments): one step of the MoE demo at EP 2, as
# the MoE walkthrough runs it, and at EP 2 x TP 2 (its exercise)
MOE = {"moe_ep2": (2, ["--ep", "2"]), "moe_ep2_tp2": (4, ["--ep", "2", "--tp", "2"])}
MOE_STEP = ["--moe", "--steps", "1", "--device", "cpu", "--json"]


def moe_trace(stdout: str) -> dict:
    """The MoE demo's `--json` lines as one trace: its config line, then its steps."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    config, steps = lines[0]["config"], lines[1:]
    return {"kind": "moe", "world": config["world"], "config": config, "steps": steps}


def _json_text(stdout: str) -> str:
    return stdout[stdout.index("{") :]


CP_BLOCKS = "cp_blocks"  # each cp rank's ring-attention blocks per ring step, unbalanced and balanced (CP walkthrough)
CP_RANKS = 4
# trace name -> (ranks, torchrun arguments, the trace's text from the run's stdout): the activation-memory
# benchmark on two ranks, the DTensor demo runs of DTENSOR, the MoE demo runs of MOE, and cp_blocks
PRINTED = {
    "activation_memory": (2, ["benchmarks/bench_activation_memory.py", *ACTIVATION_MEMORY, "--json"], _json_text),
    **{n: (2, ["-m", "reference.hf_tp", "--device", "cpu", *a, "--json"], _json_text) for n, a in DTENSOR.items()},
    **{
        n: (r, ["-m", "reference", *MOE_STEP, *a], lambda out: json.dumps(moe_trace(out)) + "\n")
        for n, (r, a) in MOE.items()
    },
    CP_BLOCKS: (CP_RANKS, ["-m", "reference.measure.cp_blocks", "--json"], _json_text),
}


def record_printed(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Write out/NAME.json for every run of PRINTED (each of `only`) from what it prints; the paths written."""
    traced = {
        name: text(_torchrun(ranks, *argv, what=" ".join(argv), timeout=timeout))
        for name, (ranks, argv, text) in PRINTED.items()
        if only is None or name in only
    }  # all finish (or fail) before anything is written
    return _write(out, traced)


record_cp_blocks = functools.partial(record_printed, only=[CP_BLOCKS])  # the CP trace alone


FSDP_COMPARE = "fsdp1_vs_fsdp2"  # tools/fsdp_compare.py on fsdp_compare.WORLD ranks
record_fsdp_compare = functools.partial(
    record, script=ROOT / "tools" / "fsdp_compare.py", runs=[(4, None, [FSDP_COMPARE])]
)


TRACES = (
    *(name for _, _, names in WORKER_RUNS for name in names),
    *SCALE,
    *MOE_SCALE,
    "layout_grid",
    *PRINTED,
    FSDP_COMPARE,
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="record-traces", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "reading_notes" / "traces", help="output folder")
    parser.add_argument(
        "--only", nargs="+", choices=TRACES, metavar="NAME", help=f"record only these traces: {', '.join(TRACES)}"
    )
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():  # before minutes of recording, not after
        print(f"record-traces: error: --out {args.out} is not a folder", file=sys.stderr)
        return 2
    try:
        recorded = [
            step(args.out, only=args.only)
            for step in (
                record,
                record_scale,
                record_layout_grid,
                record_printed,
                record_fsdp_compare,
            )
        ]
        for path in sum(recorded, []):
            print(path)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        print(f"record-traces: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the output folder: permissions, a full disk
        print(f"record-traces: error: {exc.strerror or exc}: {exc.filename or args.out}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
