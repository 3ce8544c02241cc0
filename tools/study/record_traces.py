"""`tools/record-traces [--out DIR] [--only NAME ...]`: re-record the runs the study site's diagrams and numbers
come from.

Runs tools/trace_worker.py on two ranks under torchrun (CPU, gloo) and writes DIR/tp_block.json,
DIR/tp_block_llama.json, DIR/fsdp_forward.json and DIR/fsdp2_forward.json (default reading_notes/traces/, which
is committed), then
on four ranks (four pipeline stages) DIR/pipeline_gpipe.json, DIR/pipeline_1f1b.json,
DIR/pipeline_interleaved.json and the zero-bubble DIR/pipeline_zb_h1.json, DIR/pipeline_zbv.json and
DIR/pipeline_dualpipev.json. tests/tools/test_traces.py runs the same worker and fails when a fresh run no
longer matches the committed traces, so re-record after changing the reference and commit the result. Then, in
one process each, `python -m reference.measure.scale --json` traces a first, middle and last stage rank of the layouts
in SCALE (fake process group, 70B shapes) into DIR/scale_*.json, checked by tests/reference/test_scale.py (which
traces the same setups in-process), and the MoE layers of MOE_SCALE into DIR/moe_scale_*.json
(tests/reference/test_moe_scale.py), and `python -m reference.measure.scale.grid` writes the same closed forms over a
grid of layouts into DIR/layout_grid.json (the Scale page's calculator; tests/reference/test_scale_grid.py). Then,
on two ranks, benchmarks/bench_activation_memory.py --json counts
one block's activation bytes per configuration of Korthikanti et al.'s Table 2, the GPT-2 block and the Llama
block, into DIR/activation_memory.json, at the shapes of the test worker that checks it
(tests/reference/test_activation_memory.py). Then, on two ranks each, `-m reference.hf_tp --json` (PyTorch DTensor's
plan on HF's Qwen2, without and with sequence parallelism) into DIR/dtensor_qwen2.json and
DIR/dtensor_qwen2_sp.json, checked by tests/reference/test_hf_tp_demo.py; one step of the MoE demo (`-m reference
--moe --json`) at EP 2 on two ranks and EP 2 x TP 2 on four into DIR/moe_ep2.json and DIR/moe_ep2_tp2.json, checked
by tests/reference/test_moe_demo.py. Last, on four ranks, tools/fsdp_compare.py (PyTorch's FSDP1 and FSDP2 on one
model, side by side) into DIR/fsdp1_vs_fsdp2.json, checked by tests/evidence/test_fsdp1_vs_fsdp2.py, and
`-m reference.measure.cp_blocks --json` (each cp rank's ring-attention blocks per ring step, without and with
head-tail balancing) into DIR/cp_blocks.json, checked by tests/evidence/test_cp_blocks_freshness.py. `--only NAME ...`
writes just those
traces (and runs just the recordings that make them), leaving the others as they are. Exit status: 0
recorded, 1 a run failed (its output is printed), 2 a usage error (an unknown trace name).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
# trace name -> python -m reference.measure.scale arguments: 70B on TP 8 x PP 8 x DP 64 (1F1B, DDP in 25 MiB buckets),
# plain TP, with sequence parallelism, and with the distributed optimizer; then the same 4,096 ranks as TP 8 x DP 512
# without pipelining (the reference FSDP2 takes one micro-batch), FSDP2 over DP and HSDP (8 replicas of 64)
SCALE_70B = ["--model", "70b", "--tp", "8", "--pp", "8", "--dp", "64", "--micro-batches", "16"]
SCALE_70B_FSDP2 = ["--model", "70b", "--tp", "8", "--pp", "1", "--dp", "512", "--micro-batches", "1"]
SCALE = {
    "scale_70b": SCALE_70B,
    "scale_70b_sp": [*SCALE_70B, "--sequence-parallel"],
    "scale_70b_distopt": [*SCALE_70B, "--dp-sharding", "optimizer"],
    "scale_70b_fsdp2": [*SCALE_70B_FSDP2, "--dp-sharding", "fsdp2"],
    "scale_70b_hsdp": [*SCALE_70B_FSDP2, "--dp-sharding", "fsdp2", "--dp-replicate", "8"],
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
    with the tail of its output."""
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


def record(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Run the worker into a scratch folder, then move each trace (each of `only`) into `out`; the paths
    written."""
    with tempfile.TemporaryDirectory(prefix="traces-") as scratch:
        for ranks, what, names in WORKER_RUNS:
            if only is not None and not set(names) & set(only):
                continue
            _torchrun(ranks, WORKER, scratch, what, what=f"trace worker ({what}, {ranks} ranks)", timeout=timeout)
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


def record_activation_memory(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Write out/activation_memory.json from the activation-memory benchmark on two ranks (unless `only` leaves
    it out); the paths written."""
    if only is not None and "activation_memory" not in only:
        return []
    script = ROOT / "benchmarks" / "bench_activation_memory.py"
    stdout = _torchrun(2, script, *ACTIVATION_MEMORY, "--json", what="bench_activation_memory --json", timeout=timeout)
    return _write(out, {"activation_memory": stdout[stdout.index("{") :]})


# trace name -> `torchrun --nproc-per-node 2 -m reference.hf_tp --json` arguments: PyTorch DTensor's plan on HF's
# Qwen2ForCausalLM, without and with sequence parallelism (the DTensor walkthrough's worked example)
DTENSOR = {"dtensor_qwen2": [], "dtensor_qwen2_sp": ["--sequence-parallel"]}


def record_dtensor(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Write out/NAME.json for every DTensor demo run in DTENSOR (each of `only`), on two ranks each; the paths
    written."""
    traced = {
        name: _torchrun(
            2,
            *("-m", "reference.hf_tp", "--device", "cpu", *args, "--json"),
            what=f"reference.hf_tp {' '.join(args)} --json",
            timeout=timeout,
        )
        for name, args in DTENSOR.items()
        if only is None or name in only
    }  # all finish (or fail) before anything is written
    return _write(out, {name: stdout[stdout.index("{") :] for name, stdout in traced.items()})


# trace name -> (ranks, `torchrun -m reference --moe ... --json` arguments): one step of the MoE demo at EP 2, as
# the MoE walkthrough runs it, and at EP 2 x TP 2 (its exercise)
MOE = {"moe_ep2": (2, ["--ep", "2"]), "moe_ep2_tp2": (4, ["--ep", "2", "--tp", "2"])}
MOE_STEP = ["--moe", "--steps", "1", "--device", "cpu", "--json"]


def moe_trace(stdout: str) -> dict:
    """The MoE demo's `--json` lines as one trace: its config line, then its steps."""
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    config, steps = lines[0]["config"], lines[1:]
    return {"kind": "moe", "world": config["world"], "config": config, "steps": steps}


def record_moe(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Write out/NAME.json for every MoE demo run in MOE (each of `only`); the paths written."""
    traced = {
        name: _torchrun(
            ranks, "-m", "reference", *MOE_STEP, *args, what=f"reference --moe {' '.join(args)} --json", timeout=timeout
        )
        for name, (ranks, args) in MOE.items()
        if only is None or name in only
    }  # all finish (or fail) before anything is written
    return _write(out, {name: json.dumps(moe_trace(stdout)) + "\n" for name, stdout in traced.items()})


CP_BLOCKS = "cp_blocks"  # torchrun -m reference.measure.cp_blocks --json on CP_RANKS ranks (the CP walkthrough)
CP_RANKS = 4


def record_cp_blocks(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Write out/cp_blocks.json: the ring-attention blocks of every cp rank and ring step, unbalanced and
    balanced, from reference.measure.cp_blocks on CP_RANKS ranks (unless `only` leaves it out)."""
    if only is not None and CP_BLOCKS not in only:
        return []
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={CP_RANKS}"]
    cmd += ["--max-restarts=0", "-m", "reference.measure.cp_blocks", "--json"]
    stdout = _run(cmd, "reference.measure.cp_blocks --json", timeout, TORCH_CPP_LOG_LEVEL="ERROR")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / f"{CP_BLOCKS}.json", stdout[stdout.index("{") :].encode())
    return [out / f"{CP_BLOCKS}.json"]


FSDP_COMPARE = "fsdp1_vs_fsdp2"  # tools/fsdp_compare.py on fsdp_compare.WORLD ranks


def record_fsdp_compare(out: Path, timeout: float = 300, only: Collection[str] | None = None) -> list[Path]:
    """Write out/fsdp1_vs_fsdp2.json from tools/fsdp_compare.py on four ranks (unless `only` leaves it out)."""
    if only is not None and FSDP_COMPARE not in only:
        return []
    with tempfile.TemporaryDirectory(prefix="traces-") as scratch:
        _torchrun(4, ROOT / "tools" / "fsdp_compare.py", scratch, what="fsdp_compare (4 ranks)", timeout=timeout)
        out.mkdir(parents=True, exist_ok=True)
        shutil.move(str(Path(scratch) / f"{FSDP_COMPARE}.json"), out / f"{FSDP_COMPARE}.json")
    return [out / f"{FSDP_COMPARE}.json"]


TRACES = (
    *(name for _, _, names in WORKER_RUNS for name in names),
    *SCALE,
    *MOE_SCALE,
    "layout_grid",
    "activation_memory",
    *DTENSOR,
    *MOE,
    FSDP_COMPARE,
    CP_BLOCKS,
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
                record_activation_memory,
                record_dtensor,
                record_moe,
                record_fsdp_compare,
                record_cp_blocks,
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
