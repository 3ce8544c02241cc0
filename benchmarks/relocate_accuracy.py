"""Relocation accuracy on real upstream history: megatron-core releases from PyPI as a local git history.

Each release's megatron/core/**/*.py (from `pip download --no-deps megatron-core==X`, cached outside the
repository) becomes one commit of a local repository. For every pair of releases (all adjacent pairs and a
few long jumps) citations are generated at the old release: random line ranges of 3-40 lines (seeded) and
every symbol with a unique qualified name, in files present at both releases. Three methods answer them:

  engine      `tools/pin-and-cite relocate --source REPO --from OLD --to NEW --json -` (one process per pair)
  keep-lines  the status quo of code-in-docs tools: the same line numbers, claimed unchanged
  git-diff    the range mapped through `git diff -U0` hunks: untouched -> shifted (unchanged/moved);
              overlapped by a hunk -> changed (the hull of the mapped lines); wholly deleted -> deleted

Ground truth is computed here, independently of the engine (its own line normalization and AST walk):
  ranges   let B be the cited lines (trailing whitespace stripped). B found exactly once in the new file at
           line p -> "same text": correct answer is unchanged (p == old start) or moved, with lines p..p+len-1.
           B found more than once -> "duplicated": reported separately (any exact copy, or a flag, is not wrong).
           B not found -> "modified or deleted": correct answer is any flag (changed or deleted). Where the
           innermost definition holding B is defined once at both releases, a useful flag is `changed` with
           lines inside that definition's new span ("changed in its def": the share of those cases answered so;
           a proxy, since code can legitimately move to another definition or be rewritten beyond recognition).
  symbols  the qualified name defined once at the new release: its span there, unchanged/moved if its text
           (trailing whitespace stripped) is identical, else changed; correct = status and lines both right.
           Name gone or defined twice at the new release: correct = changed or deleted.
  silent wrong pointer: any answer unchanged/moved whose lines at the new release do not hold exactly the
           cited text (in the file the answer names: code followed into another file counts as flagged here,
           and benchmarks/relocate_crossfile.py scores those answers).
           Targets: 0; same-text ranges relocated >= 99.9%; symbols >= 99.5%; flagged >= 99%.

    .venv/bin/python benchmarks/relocate_accuracy.py [--ranges N] [--json]
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import os
import random
import re
import subprocess
import sys
import time
import zipfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("RELOCATE_BENCH_CACHE", Path.home() / ".cache" / "relocate-bench"))
VERSIONS = ["0.8.0", "0.9.0", "0.10.0", "0.11.0", "0.12.0", "0.13.0", "0.14.0", "0.15.0", "0.16.0", "0.16.1"]
LONG_JUMPS = [("0.8.0", "0.16.1"), ("0.8.0", "0.12.0"), ("0.12.0", "0.16.1")]
GIT = ["git", "-c", "user.name=bench", "-c", "user.email=bench@example.com"]


# -- the history ------------------------------------------------------------------------------------------


def wheel(version: str) -> Path:
    wheels = CACHE / "wheels"
    found = sorted(wheels.glob(f"megatron_core-{version}-*.whl"))
    if not found:
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps"]
        subprocess.run([*pip, f"megatron-core=={version}", "-d", str(wheels)], check=True)
        found = sorted(wheels.glob(f"megatron_core-{version}-*.whl"))
    return found[0]


def build_history() -> tuple[Path, dict[str, str]]:
    """A local repository with one commit per release (tagged vX); returns it and version -> commit."""
    repo = CACHE / f"history-{'-'.join(VERSIONS)}"
    if not (repo / ".git").exists():
        subprocess.run(["rm", "-rf", str(repo)], check=True)
        commit_history(repo, {f"v{version}": wheel_files(version) for version in VERSIONS})
    commits = {v: git(repo, "rev-parse", f"v{v}^{{commit}}").strip() for v in VERSIONS}
    return repo, commits


def commit_history(where: Path, commits: dict[str, dict[str, str]]) -> None:
    """A repository at `where` holding one commit per entry (tag -> path -> text), in order, each tagged."""
    subprocess.run(GIT + ["init", "-q", str(where)], check=True)
    for tag, files in commits.items():
        subprocess.run(["git", "-C", str(where), "rm", "-rq", "--ignore-unmatch", "."], check=True)
        for rel, text in files.items():
            (where / rel).parent.mkdir(parents=True, exist_ok=True)
            (where / rel).write_text(text)
        subprocess.run(["git", "-C", str(where), "add", "-A"], check=True)
        subprocess.run(GIT + ["-C", str(where), "commit", "-qm", tag], check=True)
        subprocess.run(["git", "-C", str(where), "tag", tag], check=True)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def wheel_files(version: str) -> dict[str, str]:
    """path -> text of megatron/core/*.py of a megatron-core release (relocate_crossfile reads them too)."""
    with zipfile.ZipFile(wheel(version)) as whl:
        return {
            name: whl.read(name).decode("utf-8")
            for name in whl.namelist()
            if name.startswith("megatron/core/") and name.endswith(".py")
        }


def lines(text: str) -> list[str]:
    """The text's lines, split on '\\n' only, as git numbers them."""
    out = text.split("\n")
    return out[:-1] if out and out[-1] == "" else out


@functools.cache
def files_at(version: str) -> dict[str, list[str]]:
    """path -> lines of every file the release's commit holds."""
    return {name: lines(text) for name, text in wheel_files(version).items()}


# -- ground truth (independent of the engine) -------------------------------------------------------------


def norm(lines: list[str]) -> list[str]:
    return [line.rstrip() for line in lines]


def qualified_spans(lines: list[str]) -> dict[str, list[tuple[int, int]]]:
    """Every class/function's dotted name (nesting through classes and functions, not through if/try/...)
    -> its spans from first decorator to last line. Unparsable files have none."""
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return {}
    spans: dict[str, list[tuple[int, int]]] = {}
    stack = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                top = min([child.lineno] + [d.lineno for d in child.decorator_list])
                spans.setdefault(name, []).append((top, child.end_lineno))
                stack.append((child, name + "."))
            elif isinstance(child, (ast.stmt, ast.excepthandler)):
                stack.append((child, prefix))
    return spans


def occurrences(block: list[str], lines: list[str]) -> list[int]:
    n = len(block)
    return [i + 1 for i in range(len(lines) - n + 1) if lines[i] == block[0] and lines[i : i + n] == block]


def truth_for_range(old: list[str], new: list[str], start: int, end: int) -> tuple[str, tuple | None]:
    found = occurrences(norm(old[start - 1 : end]), norm(new))
    if len(found) == 1:
        p = found[0]
        return ("unchanged" if p == start else "moved"), (p, p + end - start)
    return ("duplicated", None) if found else ("flag", None)


def home(old_spans: dict, new_spans: dict, start: int, end: int) -> tuple[int, int] | None:
    """Where edited lines should be looked for: the new span of the innermost definition holding them at the
    old release, when that name is defined exactly once at both releases."""
    holding = [
        (b - a, name)
        for name, spans in old_spans.items()
        if len(spans) == 1
        for a, b in spans
        if a <= start and end <= b
    ]
    if not holding:
        return None
    spans = new_spans.get(min(holding)[1], [])
    return spans[0] if len(spans) == 1 else None


def truth_for_symbol(
    old: list[str], new: list[str], span: tuple[int, int], new_spans: list
) -> tuple[str, tuple | None]:
    if len(new_spans) != 1:
        return "flag", None
    a, b = new_spans[0]
    if norm(new[a - 1 : b]) != norm(old[span[0] - 1 : span[1]]):
        return "changed", (a, b)
    return ("unchanged" if (a, b) == span else "moved"), (a, b)


# -- baselines -------------------------------------------------------------------------------------------


def keep_lines(new: list[str], start: int, end: int) -> tuple[str, tuple | None]:
    return ("unchanged", (start, end)) if end <= len(new) else ("deleted", None)


def diff_hunks(repo: Path, old: str, new: str) -> dict[str, list[tuple[int, int, int, int]]]:
    """path -> [(old_start, old_count, new_start, new_count)] from `git diff -U0` (myers, as git does)."""
    hunks: dict[str, list] = {}
    path = None
    for line in git(repo, "diff", "-U0", "--no-renames", old, new).splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else None
        elif line.startswith("@@") and path:
            m = re.match(r"@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@", line)
            hunks.setdefault(path, []).append((int(m[1]), int(m[2] or 1), int(m[3]), int(m[4] or 1)))
    return hunks


def through_diff(hunks: list, start: int, end: int) -> tuple[str, tuple | None]:
    """Map old lines through the hunks: a line outside every hunk shifts by the net size of the hunks above."""

    def mapped(line: int) -> int | None:
        shift = 0
        for a, b, c, d in hunks:
            if b and a <= line < a + b:  # inside a changed hunk: its new counterpart, if any
                return c + min(line - a, d - 1) if d else None
            if (a + b - 1 if b else a) < line:
                shift += d - b
        return line + shift

    touched = any((b and a <= end and start < a + b) or (not b and start <= a < end) for a, b, _, _ in hunks)
    ends = [m for m in (mapped(x) for x in range(start, end + 1)) if m is not None]
    if not ends:
        return "deleted", None
    lines = (min(ends), max(ends))
    if touched:
        return "changed", lines
    return ("unchanged" if lines == (start, end) else "moved"), lines


# -- one pair --------------------------------------------------------------------------------------------


def engine(repo: Path, old: str, new: str, cites: list[str], cache: Path = CACHE / "pin-and-cite"):
    """`pin-and-cite relocate` of `cites` from `old` to `new` in one process: its answers, and its wall seconds
    (relocate_crossfile runs it too)."""
    started = time.perf_counter()
    proc = subprocess.run(
        [str(ROOT / "tools" / "pin-and-cite"), "relocate", "--source", str(repo), "--from", old, "--to", new]
        + ["--json", "-"],
        input="\n".join(cites) + "\n",
        capture_output=True,
        text=True,
        env={**os.environ, "PIN_AND_CITE_CACHE": str(cache)},
    )
    if proc.returncode not in (0, 1):
        raise SystemExit(f"relocate failed: {proc.stderr}")
    return json.loads(proc.stdout), time.perf_counter() - started


def evaluate(repo: Path, commits: dict, old_v: str, new_v: str, n_ranges: int, rng: random.Random) -> list[dict]:
    old_c, new_c = commits[old_v], commits[new_v]
    old_files, new_files = files_at(old_v), files_at(new_v)
    common = sorted(p for p in old_files if p in new_files and old_files[p])
    weights = [len(old_files[p]) for p in common]
    cases = []  # (cite, path, (start, end) cited, truth, truth lines)
    spans_at = {path: (qualified_spans(old_files[path]), qualified_spans(new_files[path])) for path in common}
    for path in rng.choices(common, weights, k=n_ranges):
        lines = old_files[path]
        length = rng.randint(3, 40)
        start = rng.randint(1, max(1, len(lines) - length + 1))
        end = min(len(lines), start + length - 1)
        truth, truth_lines = truth_for_range(lines, new_files[path], start, end)
        if truth == "flag":
            truth_lines = home(*spans_at[path], start, end)
        cases.append((f"{path}#L{start}-L{end}", path, (start, end), "range", truth, truth_lines))
    for path in common:
        old_spans, new_spans = spans_at[path]
        for name, spans in sorted(old_spans.items()):
            if len(spans) == 1:
                cases.append(
                    (
                        f"{path}::{name}",
                        path,
                        spans[0],
                        "symbol",
                        *truth_for_symbol(old_files[path], new_files[path], spans[0], new_spans.get(name, [])),
                    )
                )
    hunks = diff_hunks(repo, old_c, new_c)
    answers = {"engine": engine(repo, old_c, new_c, [c[0] for c in cases])}
    answers["keep-lines"] = ([dict(zip(("status", "lines"), keep_lines(new_files[c[1]], *c[2]))) for c in cases], 0.0)
    answers["git-diff"] = (
        [dict(zip(("status", "lines"), through_diff(hunks.get(c[1], []), *c[2]))) for c in cases],
        0.0,
    )
    rows = []
    for method, (found, seconds) in answers.items():
        tally = Counter()
        for (_cite, path, (start, end), kind, truth, truth_lines), answer in zip(cases, found):
            status, lines = answer["status"], tuple(answer["lines"]) if answer["lines"] else None
            claims_same = status in ("unchanged", "moved")
            at = answer.get("path") or path  # the engine may follow code into another file
            if claims_same and norm(new_files[at][lines[0] - 1 : lines[1]]) != norm(old_files[path][start - 1 : end]):
                tally["silent_wrong"] += 1
            flagged = status in ("changed", "deleted") or at != path  # another file: see relocate_crossfile
            if kind == "symbol":
                tally["symbols"] += 1
                tally["symbols_ok"] += flagged if truth == "flag" else (status, lines) == (truth, truth_lines)
            elif truth == "flag":
                tally["modified"] += 1
                tally["modified_flagged"] += flagged
                if truth_lines:  # is it a changed pointer into the right definition?
                    tally["changed_homed"] += 1
                    tally["changed_homed_ok"] += (
                        status == "changed" and truth_lines[0] <= lines[0] <= lines[1] <= truth_lines[1]
                    )
            elif truth == "duplicated":
                tally["duplicated"] += 1
            else:
                tally["same_text"] += 1
                tally["same_text_ok"] += (status, lines) == (truth, truth_lines)
            tally["errors"] += status == "error"
        rows.append(
            {
                "pair": f"{old_v} -> {new_v}",
                "method": method,
                "cites": len(cases),
                "seconds": round(seconds, 2),
                **tally,
            }
        )
    return rows


def pct(ok: int, n: int) -> str:
    return f"{100 * ok / n:.2f}% ({n})" if n else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranges", type=int, default=2000, help="random range citations per pair (default 2000)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    repo, commits = build_history()
    pairs = list(zip(VERSIONS, VERSIONS[1:])) + LONG_JUMPS
    rows = []
    for k, (old_v, new_v) in enumerate(pairs):
        rows += evaluate(repo, commits, old_v, new_v, args.ranges, random.Random(k))
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    header = (
        "pair",
        "method",
        "same-text relocated",
        "modified flagged",
        "changed in its def",
        "symbols correct",
        "dup",
        "silent wrong",
        "errors",
        "relocate: cites, wall",
    )
    table = [header] + [
        (
            r["pair"],
            r["method"],
            pct(r["same_text_ok"], r["same_text"]),
            pct(r["modified_flagged"], r["modified"]),
            pct(r.get("changed_homed_ok", 0), r.get("changed_homed", 0)),
            pct(r["symbols_ok"], r["symbols"]),
            str(r.get("duplicated", 0)),
            str(r.get("silent_wrong", 0)),
            str(r.get("errors", 0)),
            f"{r['cites']} in {r['seconds']:.1f}s" if r["method"] == "engine" else "",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for row in table:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    for method in ("engine", "keep-lines", "git-diff"):
        total = Counter()
        for r in rows:
            if r["method"] == method:
                total.update({k: v for k, v in r.items() if isinstance(v, int) and k != "cites"})
        print(
            f"all pairs, {method}: same-text {pct(total['same_text_ok'], total['same_text'])}, flagged "
            f"{pct(total['modified_flagged'], total['modified'])}, changed in its def "
            f"{pct(total['changed_homed_ok'], total['changed_homed'])}, "
            f"symbols {pct(total['symbols_ok'], total['symbols'])}, "
            f"silent wrong pointers {total['silent_wrong']}"
        )


if __name__ == "__main__":
    main()
