"""Cross-file relocation: citations whose code left its file, scored on histories built here.

Histories (each two commits of a throwaway repository under the cache, never in this project):
  synthetic   (default) generated code (no upstream text) with the moves Megatron-LM 0.10.0 made, per seed:
              four DistributedDataParallel methods moved with identical text into a new data_parallel_base.py,
              grad_buffer.py renamed param_and_grad_buffer.py and edited, functions moved into a sibling and
              into a far directory, one moved and edited, one copied into two files, some deleted, and churn
              in unrelated files; and code whose other copy already lived in a file the commit left UNCHANGED
              (a deleted legacy/fused_ops.py whose functions live on in fusions/fused_ops.py, as Megatron's
              legacy fused_bias_gelu.py; two utils functions kept in datasets/ files, one of them imported);
  --megatron  megatron-core 0.9.0 and 0.10.0 from PyPI (`pip download --no-deps`, cached outside the project);
  --mirror DIR  a Megatron-LM clone as it is, for each pair of adjacent tags of --tags; cited: every unique
              definition (and body) of megatron/**/*.py that is gone from its file at the newer tag.

Citations: every uniquely named definition of the cited files at the old commit, and its body as a range
(synthetic: the five files the moves touch; megatron: megatron/core/distributed/*.py). Ground truth is computed
here from the texts, independently of the engine: the cited lines (trailing whitespace stripped) found
  once in the same file            -> same-file: correct = unchanged/moved there;
  not in the same file, once elsewhere -> moved away: correct = unchanged/moved at that path and lines
                                       (kept elsewhere, when that file is the same at both commits);
  not in the same file, several times elsewhere -> ambiguous: correct = changed (never moved);
  nowhere                          -> edited or gone: correct = changed or deleted (flagged).
Silent wrong pointer: an unchanged/moved answer whose lines at its path do not hold exactly the cited text.
Time: wall and CPU seconds of one `relocate` process per set (same-file, cross-file), CPU being steadier on a
shared machine. Reads: the blobs (and KiB) the runs put in their cache, against the new commit's files.

    .venv/bin/python benchmarks/relocate_crossfile.py [--seeds 5] [--megatron]
    .venv/bin/python benchmarks/relocate_crossfile.py --mirror /work/.mirror/NVIDIA+Megatron-LM/repo
"""

from __future__ import annotations

import argparse
import ast
import functools
import random
import resource
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

# the same PyPI wheel cache and the same ground-truth helpers (benchmarks/ is on the path)
from relocate_accuracy import CACHE, commit_history, engine, lines, norm, qualified_spans, wheel_files

# -- synthetic histories ----------------------------------------------------------------------------------


class Writer:
    """Generated Python: functions and classes of made-up statements, unique per seed."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def word(self) -> str:
        stem = self.rng.choice("grad param bucket shard rank group buffer stream".split())
        return f"{stem}_{self.rng.randrange(10**6)}"

    def function(self, name: str, indent: str = "", method: bool = False, lines: tuple = (3, 12)) -> str:
        args = ", ".join(["self"] * method + [self.word() for _ in range(self.rng.randint(0, 3))])
        body = [f'{indent}    """{self.word()} for {self.word()}."""']
        for _ in range(self.rng.randint(*lines)):
            body.append(f"{indent}    {self.word()} = {self.word()}({self.word()}) * {self.rng.randint(1, 9)}")
        body.append(f"{indent}    return {self.word()}")
        return f"{indent}def {name}({args}):\n" + "\n".join(body) + "\n"

    def module(self, functions: dict[str, str], classes: dict[str, dict[str, str]] | None = None) -> str:
        parts = [f'"""{self.word()}."""\nimport torch\n']
        parts += [
            f'class {cls}:\n    """{self.word()}."""\n\n' + "\n".join(methods.values())
            for cls, methods in (classes or {}).items()
        ]
        parts += list(functions.values())
        return "\n\n".join(parts)

    def functions(self, prefix: str, n: int) -> dict[str, str]:
        return {f"{prefix}_{k}": self.function(f"{prefix}_{k}") for k in range(n)}

    def methods(self, names: list[str]) -> dict[str, str]:
        return {name: self.function(name, "    ", method=True) for name in names}


def edited(rng: random.Random, text: str) -> str:
    """The text with one body line rewritten."""
    lines = text.split("\n")
    k = rng.choice([i for i, line in enumerate(lines) if " = " in line])
    lines[k] = lines[k].replace(" * ", " + ", 1)
    return "\n".join(lines)


def synthetic(seed: int) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(files at the old commit, files at the new one, the cited paths)."""
    rng = random.Random(seed)
    w = Writer(rng)
    moved_names = ["forward", "state_dict", "load_state_dict", "state_dict_for_save_checkpoint"]
    ddp = w.methods(["__init__", *moved_names, "zero_grad_buffer", "start_grad_sync", "finish_grad_sync"])
    buffer_methods = w.methods(
        ["__init__", "reset", "scale_gradients", "start_param_sync", "finish_param_sync", "register_grad_ready"]
    )
    buffer_functions = w.functions("partition", 3)
    utils = w.functions("util", 8)
    finalize = w.functions("finalize", 6)
    gpt = w.functions("gpt_helper", 5)
    noise = {f"core/transformer/block_{k}.py": w.functions(f"block_{k}", 6) for k in range(6)}
    noise.update({f"core/tensor_parallel/layer_{k}.py": w.functions(f"layer_{k}", 6) for k in range(4)})
    old = {
        "core/distributed/distributed_data_parallel.py": w.module({}, {"DistributedDataParallel": ddp}),
        "core/distributed/grad_buffer.py": w.module(buffer_functions, {"GradBuffer": buffer_methods}),
        "core/distributed/finalize_model_grads.py": w.module(finalize),
        "core/utils.py": w.module(utils),
        "core/models/gpt/gpt_model.py": w.module(gpt),
        **{path: w.module(fns) for path, fns in noise.items()},
    }
    cited = list(old)[:5]
    new_buffer = dict(buffer_methods)
    for name in ("reset", "start_param_sync"):
        new_buffer[name] = edited(rng, new_buffer[name])
    new_buffer["grad_data"] = w.function("grad_data", "    ", method=True)
    kept_ddp = {k: v for k, v in ddp.items() if k not in moved_names}
    base = {"__init__": w.function("__init__", "    ", method=True), **{k: ddp[k] for k in moved_names}}
    to_sibling, to_far = ["util_0", "util_1", "util_2"], ["gpt_helper_0"]
    copied, deleted = "util_3", ["util_4", "finalize_5", "gpt_helper_4"]
    new = {
        "core/distributed/distributed_data_parallel.py": w.module({}, {"DistributedDataParallel": kept_ddp}),
        "core/distributed/data_parallel_base.py": w.module({}, {"_BaseDataParallel": base}),
        "core/distributed/param_and_grad_buffer.py": "# header\n" * 5
        + w.module(buffer_functions, {"GradBuffer": new_buffer}),
        "core/distributed/finalize_model_grads.py": w.module(
            {k: v for k, v in finalize.items() if k not in ("finalize_4", *deleted)}
        ),
        "core/distributed/dist_utils.py": w.module({k: utils[k] for k in to_sibling}),
        "core/distributed/grad_helpers.py": w.module({"finalize_4": edited(rng, finalize["finalize_4"])}),
        "core/utils.py": w.module({k: v for k, v in utils.items() if k not in (*to_sibling, copied, *deleted)}),
        "core/models/gpt/gpt_model.py": w.module({k: v for k, v in gpt.items() if k not in (*to_far, *deleted)}),
        "core/tensor_parallel/random_utils.py": w.module({k: gpt[k] for k in to_far}),
        "core/transformer/copy_a.py": w.module({copied: utils[copied]}),
        "core/transformer/copy_b.py": w.module({copied: utils[copied]}),
        **{path: w.module({**fns, **w.functions(f"churn_{i}", 2)}) for i, (path, fns) in enumerate(noise.items())},
    }
    kept_old, kept_new = kept_elsewhere(seed, old["core/utils.py"], new["core/utils.py"])
    old.update(kept_old)
    new.update(kept_new)
    return old, new, [*cited, "core/legacy/fused_ops.py"]


def kept_elsewhere(seed: int, utils_old: str, utils_new: str) -> tuple[dict[str, str], dict[str, str]]:
    """Code that already lived in a second file, the same at both commits, whose cited copy goes: a legacy
    file deleted (its twin has the same name), and two utils functions (one imported from its survivor)."""
    w = Writer(random.Random(10_000 + seed))
    gelu = f'class FusedGelu:\n    """{w.word()}."""\n\n' + "\n".join(w.methods(["forward", "backward"]).values())
    fused = {**w.functions("fused", 3), "FusedGelu": gelu}
    kept = {name: w.function(name) for name in ("storage_client", "s3_download")}
    unchanged = {
        "core/fusions/fused_ops.py": w.module(fused),
        "core/datasets/object_storage.py": w.module({"storage_client": kept["storage_client"]}),
        "core/datasets/s3_utils.py": w.module({"s3_download": kept["s3_download"]}),
    }
    old = {
        **unchanged,
        "core/legacy/fused_ops.py": w.module({k: fused[k] for k in ("fused_0", "fused_1", "FusedGelu")}),
        "core/utils.py": utils_old + "\n\n" + "\n\n".join(kept.values()),
    }
    new = {**unchanged, "core/utils.py": "from core.datasets.object_storage import storage_client\n" + utils_new}
    return old, new


# -- megatron-core from PyPI ---------------------------------------------------------------------------


def megatron() -> tuple[dict[str, str], dict[str, str], list[str]]:
    old, new = wheel_files("0.9.0"), wheel_files("0.10.0")
    return old, new, sorted(p for p in old if p.startswith("megatron/core/distributed/"))


# -- a Megatron-LM clone as it is ---------------------------------------------------------------------


def python_files(repo: Path, ref: str) -> dict[str, tuple[str, str]]:
    """path -> (blob, text) of every *.py regular file of `ref`, read in one `git cat-file --batch`."""
    listing = subprocess.run(["git", "-C", str(repo), "ls-tree", "-r", ref], check=True, capture_output=True, text=True)
    blobs = {}
    for line in listing.stdout.splitlines():
        meta, path = line.split("\t", 1)
        mode, kind, oid = meta.split()
        if kind == "blob" and mode.startswith("100") and path.endswith(".py"):
            blobs[path] = oid
    batch = subprocess.run(
        ["git", "-C", str(repo), "cat-file", "--batch"],
        input="".join(f"{o}\n" for o in blobs.values()).encode(),
        check=True,
        capture_output=True,
    ).stdout
    texts, at = {}, 0
    while at < len(batch):
        header_end = batch.index(b"\n", at)
        oid, _, size = batch[at:header_end].decode().split()
        texts[oid] = batch[header_end + 1 : header_end + 1 + int(size)].decode("utf-8", "replace")
        at = header_end + 1 + int(size) + 1
    return {path: (oid, texts[oid]) for path, oid in blobs.items()}


def mirror(repo: Path, old_ref: str, new_ref: str) -> History:
    """Every unique definition of megatron/**/*.py gone from its file between two tags, answered from the clone."""
    old, new = python_files(repo, old_ref), python_files(repo, new_ref)
    cited = []
    for path, (oid, text) in sorted(old.items()):
        if path.startswith("megatron/") and new.get(path, (None,))[0] != oid:
            try:
                ast.parse(text)
            except SyntaxError:
                continue
            cited.append(path)
    return History(
        repo,
        (old_ref, new_ref),
        {p: t for p, (_, t) in old.items()},
        {p: t for p, (_, t) in new.items()},
        {p for p, (oid, _) in new.items() if old.get(p, (None,))[0] == oid},
        cited,
        only_lost=True,
    )


# -- the repository and the citations ------------------------------------------------------------------


def unique_definitions(text: str) -> dict[str, tuple[int, int]]:
    """Qualified name -> (first decorator or def line, last line) of each name defined once."""
    return {name: s[0] for name, s in qualified_spans(lines(text)).items() if len(s) == 1}


def citations(old: dict[str, str], cited: list[str]) -> list[tuple[str, str, tuple[int, int]]]:
    """(cite, path, cited lines): each unique definition, and its body when it has more than one line."""
    out = []
    for path in cited:
        for name, (a, b) in sorted(unique_definitions(old[path]).items()):
            out.append((f"{path}::{name}", path, (a, b)))
            if b > a:
                out.append((f"{path}#L{a + 1}-L{b}", path, (a + 1, b)))
    return out


def line_index(new_lines: dict[str, list[str]]) -> dict[str, list[tuple[str, int]]]:
    """Line text -> every (path, 0-based line) holding it: where a block can start, without a scan per citation."""
    index: dict[str, list[tuple[str, int]]] = {}
    for path, text in new_lines.items():
        for i, line in enumerate(text):
            index.setdefault(line, []).append((path, i))
    return index


def truth(history: History, index: dict, path: str, span: tuple[int, int]) -> tuple[str, tuple | None]:
    block = norm(lines(history.old[path])[span[0] - 1 : span[1]])
    found = [
        (p, i + 1) for p, i in index.get(block[0], []) if history.new_lines[p][i : i + len(block)] == block
    ]  # 1-based starts
    same = [s for p, s in found if p == path]
    if len(same) == 1:
        return "same-file", (path, same[0], same[0] + len(block) - 1)
    if same:
        return "duplicated", None
    elsewhere = [(p, s) for p, s in found if p != path]
    if len(elsewhere) == 1:
        p, s = elsewhere[0]
        return ("kept elsewhere" if p in history.unchanged else "moved away"), (p, s, s + len(block) - 1)
    return ("ambiguous", None) if elsewhere else ("edited or gone", None)


def _children_cpu() -> float:
    """CPU seconds used by finished child processes: steadier than wall time on a shared machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass
class History:
    """Two commits of a repository and what the ground truth reads of them."""

    repo: Path
    refs: tuple[str, str]
    old: dict[str, str]  # path -> text at the old commit (at least the cited files)
    new: dict[str, str]  # path -> text at the new commit (every file an answer may point into)
    unchanged: set[str]  # paths whose text is the same at both commits
    cited: list[str]
    only_lost: bool = False  # cite only what is gone from its file (the same-file engine is scored elsewhere)

    @functools.cached_property
    def new_lines(self) -> dict[str, list[str]]:
        return {p: norm(lines(t)) for p, t in self.new.items()}


def built(old: dict[str, str], new: dict[str, str], cited: list[str], work: Path) -> History:
    """A two-commit repository of these files, under `work`."""
    commit_history(work / "repo", {"old": old, "new": new})
    return History(work / "repo", ("old", "new"), old, new, {p for p in new if old.get(p) == new[p]}, cited)


def score(history: History, work: Path) -> tuple[Counter, dict[str, float]]:
    index = line_index(history.new_lines)
    cases = citations(history.old, history.cited)
    truths = [truth(history, index, path, span) for _, path, span in cases]
    if history.only_lost:
        cases, truths = zip(*[(c, t) for c, t in zip(cases, truths) if t[0] != "same-file"]) or ((), ())
    tally, seconds = Counter(), {}
    tally["files at new"], tally["KiB at new"] = (
        len(history.new),
        sum(len(t.encode()) for t in history.new.values()) // 1024,
    )
    for kind in ("same-file", "cross-file"):
        picked = [(c, t) for c, t in zip(cases, truths) if (t[0] == "same-file") == (kind == "same-file")]
        if not picked:
            continue
        cpu = _children_cpu()
        answers, seconds[kind] = engine(history.repo, *history.refs, [c[0] for c, _ in picked], work / "cache")
        seconds[f"{kind} cpu"] = _children_cpu() - cpu
        stored = [f.stat().st_size for f in (work / "cache" / "blobs").rglob("*") if f.is_file()]
        tally["blobs read"], tally["KiB read"] = len(stored), sum(stored) // 1024  # by both runs so far
        for ((_cite, path, span), (category, where)), answer in zip(picked, answers):
            status, answer_lines = answer["status"], answer["lines"]
            at = answer.get("path") or path
            tally[category] += 1
            tally[f"{category}: {status}"] += 1
            if status in ("unchanged", "moved"):
                text = history.new_lines.get(at, [])[answer_lines[0] - 1 : answer_lines[1]]
                tally["silent wrong pointers"] += text != norm(lines(history.old[path])[span[0] - 1 : span[1]])
            if where is not None and status in ("unchanged", "moved") and (at, *answer_lines) == where:
                tally[
                    {"same-file": "same-file relocated", "kept elsewhere": "kept found"}.get(category, "relocated")
                ] += 1
            if category in ("ambiguous", "edited or gone", "duplicated") and status in ("changed", "deleted"):
                tally["flagged"] += 1
            tally["answered in another file"] += at != path and status != "deleted"
    return tally, seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="synthetic histories to build (default 5)")
    parser.add_argument("--megatron", action="store_true", help="megatron-core 0.9.0 -> 0.10.0 instead")
    parser.add_argument("--mirror", type=Path, help="a Megatron-LM clone: score each pair of adjacent --tags")
    parser.add_argument("--tags", default="core_v0.16.1,core_v0.17.0,core_v0.18.0,core_v0.19.0")
    args = parser.parse_args()
    if args.mirror:
        tags = args.tags.split(",")
        histories = [(f"{a} -> {b}", lambda _, a=a, b=b: mirror(args.mirror, a, b)) for a, b in zip(tags, tags[1:])]
    elif args.megatron:
        histories = [("megatron-core 0.9.0 -> 0.10.0", lambda work: built(*megatron(), work))]
    else:
        histories = [
            (f"synthetic seed {seed}", lambda work, seed=seed: built(*synthetic(seed), work))
            for seed in range(args.seeds)
        ]
    total, total_seconds = Counter(), Counter()
    for name, history in histories:
        with tempfile.TemporaryDirectory(dir=CACHE.mkdir(parents=True, exist_ok=True) or CACHE) as work:
            work = Path(work)
            tally, seconds = score(history(work), work)
        total.update(tally)
        total_seconds.update(seconds)
        print(
            f"{name}: "
            + ", ".join(f"{k} {v}" for k, v in sorted(tally.items()))
            + "; "
            + ", ".join(f"{k} {v:.2f}s" for k, v in seconds.items())
        )
    kept = total["kept elsewhere"]
    print(
        f"all: relocated {total['relocated']} of {total['moved away']} moved away; kept elsewhere (the other copy in "
        f"an unchanged file): found {total['kept found']}, missed {kept - total['kept found']} of {kept}; flagged "
        f"{total['flagged']} of {total['ambiguous'] + total['edited or gone'] + total['duplicated']}, silent wrong "
        f"pointers {total['silent wrong pointers']}, same-file {total['same-file relocated']} of "
        f"{total['same-file']}; read {total['blobs read']} blobs ({total['KiB read']} KiB) of {total['files at new']} "
        f"files ({total['KiB at new']} KiB) at the new commits; time: "
        + ", ".join(f"{k} {v:.2f}s" for k, v in total_seconds.items())
    )


if __name__ == "__main__":
    main()
