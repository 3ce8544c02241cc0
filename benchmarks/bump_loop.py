"""Bump Megatron-LM on its real history, then follow every piece of advice the tool prints: what gets locked.

A scratch clone of this checkout's HEAD (notes, reference/, tests/: all `check` reads), with its own
PIN_AND_CITE_CACHE in the same temporary folder (the user's cache is never written; `--cache DIR` picks one),
fetches the locked files (megatron-lm from a local Megatron-LM mirror served by a `git daemon` on loopback,
tests.gitserver.GitDaemon; pytorch from the installed torch when its blobs match), runs
`bump megatron-lm --ref core_v0.19.0`, then loops: `check --json`, and for each problem the advice it names,
followed mechanically:
  run `tools/pin-and-cite VERB ...` (on it)   -> that command is run (cite on the problem's citation), once;
                                               when it refuses, the advice it prints is followed the same way
  rewrite the claim / check the claim        -> a person's job: counted, not acted on
  install the pinned one                      -> the environment (megatron-core 0.16.1 is installed, not the
                                               bumped release): counted, not acted on
until a round has nothing left to act on. Every step is printed.

Then the property, computed here from the pre-bump lock, the final lock and the pinned blobs read from the
mirror (not from the tool): no citation is locked whose text is other code than the pre-bump text named.
Each citation of the final lock is either
  the bump's carried counterpart of a pre-bump citation: unchanged/moved with the same text (lines compared
  ignoring trailing whitespace, as the tool does), or changed and kept in the bump record for review; or
  locked by following advice, with the same text as the pre-bump citation it came from;
anything else is a violation (the goal is 0), as is a locked hash that is not its pinned file's text, or a
pytorch citation the bump of megatron-lm touched.

    .venv/bin/python benchmarks/bump_loop.py [--mirror /work/.mirror/NVIDIA+Megatron-LM/repo]
        [--ref core_v0.19.0] [--cache DIR] [--keep] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from tests.gitserver import GitDaemon

SOURCE = "megatron-lm"
ADVICE = re.compile(r"run `tools/pin-and-cite ([^`]+)`|run tools/pin-and-cite (\w+)")
PERSON = ("rewrite the claim", "check the claim")
ENVIRONMENT = ("this environment", "install the pinned one")  # the installed wheel is not the pinned one


def log(*parts: object) -> None:
    print(*parts, file=sys.stderr, flush=True)


class Tool:
    """The scratch checkout's own pin-and-cite, run as a process on it, fetching megatron-lm from the mirror."""

    def __init__(self, checkout: Path, cache: Path, url: str):
        self.checkout, self.url = checkout, url
        self.env = {
            **os.environ,
            "PIN_AND_CITE_CACHE": str(cache),
            "PYTHONPATH": f"{checkout / 'tools'}{os.pathsep}{checkout}",
        }

    def __call__(self, *args: str) -> subprocess.CompletedProcess:
        verb, rest = args[0], list(args[1:])
        command = [sys.executable, "-m", "pin_and_cite", verb, *rest, "--project", str(self.checkout)]
        if verb in ("fetch", "cite", "bump", "render", "check"):
            command += ["--url", f"{SOURCE}={self.url}"]
        return subprocess.run(
            command, cwd=self.checkout, env=self.env, capture_output=True, text=True, timeout=1800, check=False
        )


def advice_of(message: str) -> tuple[str, list[str] | None]:
    """(kind, the tool's arguments to run or None) of one piece of advice."""
    if any(p in message for p in PERSON):
        return "person", None
    if any(p in message for p in ENVIRONMENT):
        return "environment", None
    if m := ADVICE.search(message):
        return "tool", shlex.split(m.group(1) or m.group(2))
    return "unknown", None


def problem_key(problem: dict) -> str:
    """The citation a problem is about (a render problem names it at the start of its message)."""
    if problem["cite"] == "render":
        return problem["message"].split(": ", 1)[0]
    return problem["cite"]


def command_for(args: list[str], key: str) -> list[str]:
    """`cite` alone means: on the problem's citation."""
    return [*args, key] if args == ["cite"] else args


def refusal(line: str, command: str, key: str) -> tuple[str, str, str]:
    """(where, citation, advice) of one line a refusing command printed: `[FILE:LINE: ]CITATION: ADVICE`."""
    parts = line.removeprefix("pin-and-cite: error: ").split(": ")
    where = parts.pop(0) if len(parts) > 2 and re.fullmatch(r"\S+:\d+", parts[0]) else command
    if len(parts) > 1 and ":" in parts[0] and " " not in parts[0]:
        key = parts.pop(0)
    return where, key, ": ".join(parts)


def follow(tool: Tool, problems: list[dict], done: set, tally: Counter, locked_by_advice: set, steps: list) -> int:
    """Act on every piece of advice of one round not acted on before; returns how many actions were taken."""
    acted, pending = 0, [(p["where"], problem_key(p), p["message"]) for p in problems]
    while pending:
        where, key, message = pending.pop(0)
        kind, args = advice_of(message)
        if kind != "tool":
            if (where, key, message) not in done:
                done.add((where, key, message))
                tally[f"left: {kind}"] += 1
                steps.append({"where": where, "cite": key, "advice": message, "action": kind})
                log(f"  {kind:11} {where}: {key}: {message}")
            continue
        command = command_for(args, key)
        if tuple(command) in done:
            continue
        done.add(tuple(command))
        acted += 1
        result = tool(*command)
        said = (result.stderr.strip() or result.stdout.strip()).splitlines()
        outcome = "ok" if result.returncode == 0 else f"refused (exit {result.returncode})"
        tally["advice followed"] += 1
        log(f"  run         tools/pin-and-cite {shlex.join(command)}  [{where}: {message}] -> {outcome}")
        step = {"where": where, "cite": key, "advice": message, "action": "run", "command": command}
        steps.append({**step, "exit": result.returncode, "said": said[-1] if said else ""})
        if command[0] == "cite" and result.returncode == 0 and "--no-lock" not in command:
            locked_by_advice.update(a for a in command[1:] if ":" in a and not a.startswith("-"))
        if result.returncode != 0:
            tally["refused"] += 1
            for line in said:  # the refusal's own advice, followed the same way
                log(f"              {line}")
                pending.append(refusal(line, " ".join(command), key))
    return acted


# -- the property, from the texts ------------------------------------------------------------------------


def blob_texts(mirror: Path, blobs: set[str]) -> dict[str, list[str]]:
    """blob -> its lines as git numbers them (split on '\\n'), read in one `git cat-file --batch`."""
    order = sorted(blobs)
    out = subprocess.run(
        ["git", "-C", str(mirror), "cat-file", "--batch"],
        input="".join(f"{b}\n" for b in order).encode(),
        check=True,
        capture_output=True,
    ).stdout
    texts, at = {}, 0
    while at < len(out):
        end = out.index(b"\n", at)
        oid, kind, size = out[at:end].decode().split()
        data = out[end + 1 : end + 1 + int(size)].decode()
        lines = data.split("\n")
        texts[oid] = lines[:-1] if lines[-1] == "" else lines
        at = end + 1 + int(size) + 1
    return texts


def cited(lock: dict, key: str, texts: dict[str, list[str]]) -> list[str]:
    entry = lock["citations"][key]
    path = key.split(":", 1)[1].split("#", 1)[0].split("::", 1)[0]
    blob = lock["files"][f"{SOURCE}:{path}"]["blob"]
    a, b = entry["lines"]
    return texts[blob][a - 1 : b]


def same(x: list[str], y: list[str]) -> bool:
    return [line.rstrip() for line in x] == [line.rstrip() for line in y]


def verify(mirror: Path, pre: dict, post: dict, bumped: dict, locked_by_advice: set) -> tuple[Counter, list]:
    """Every citation of the final lock against the pre-bump text it stands for."""
    blobs = {f["blob"] for k, f in [*pre["files"].items(), *post["files"].items()] if k.startswith(f"{SOURCE}:")}
    texts = blob_texts(mirror, blobs)
    record = post.get("bumps", {}).get(SOURCE, {}).get("changes", {})
    carried: dict[str, list[dict]] = {}
    for c in bumped["citations"]:
        if c.get("new_cite"):
            carried.setdefault(c["new_cite"], []).append(c)
    tally, violations = Counter(), []

    def bad(key: str, why: str) -> None:
        violations.append({"cite": key, "why": why})
        log(f"  VIOLATION {key}: {why}")

    for lock, name in ((pre, "pre-bump"), (post, "final")):
        for key, entry in lock["citations"].items():
            if key.startswith(f"{SOURCE}:"):
                text = "\n".join(cited(lock, key, texts)) + "\n"
                if hashlib.sha256(text.encode()).hexdigest() != entry["text_sha256"]:
                    bad(key, f"the {name} lock's hash is not the text of its lines in the pinned file")
    for key, entry in sorted(post["citations"].items()):
        if not key.startswith(f"{SOURCE}:"):
            tally["other sources kept"] += 1
            if pre["citations"].get(key) != entry:
                bad(key, "a citation of another source changed")
            continue
        now, fine = cited(post, key, texts), []
        for c in carried.get(key, []):
            old = c["cite"]
            if c["status"] in ("unchanged", "moved"):
                fine.append(same(now, cited(pre, old, texts)))
                if not fine[-1]:
                    bad(key, f"carried from {old} as {c['status']} but its text is other code")
            elif c["status"] == "changed":
                fine.append(record.get(old, {}).get("new_cite") == key)
                if not fine[-1]:
                    bad(key, f"changed from {old} but not in the bump record for review")
        if key in locked_by_advice:
            origins = [key] if key in pre["citations"] else [c["cite"] for c in carried.get(key, [])]
            tally["locked by advice"] += 1
            for old in origins:
                fine.append(same(now, cited(pre, old, texts)))
                if not fine[-1]:
                    bad(key, f"locked by following advice, but its text is other code than {old} named")
            if not origins:
                fine.append(False)
                bad(key, "locked by following advice, with no pre-bump citation it came from")
        if not fine:
            bad(key, "locked, but neither carried by the bump nor locked by following advice")
    return tally, violations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mirror", type=Path, default=Path("/work/.mirror/NVIDIA+Megatron-LM/repo"))
    parser.add_argument("--ref", default="core_v0.19.0", help="what to bump megatron-lm to (default core_v0.19.0)")
    parser.add_argument("--cache", type=Path, help="PIN_AND_CITE_CACHE to use (default: a new one in the temp dir)")
    parser.add_argument("--keep", action="store_true", help="leave the scratch checkout (its path is printed)")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON on stdout")
    parser.add_argument("--rounds", type=int, default=10, help="at most this many check rounds (default 10)")
    args = parser.parse_args()
    mirror = args.mirror.resolve()
    work = Path(tempfile.mkdtemp(prefix="bump-loop-"))
    checkout, cache = work / "checkout", (args.cache or work / "cache")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], check=True, capture_output=True, text=True)
    subprocess.run(["git", "clone", "-q", "--no-checkout", str(ROOT), str(checkout)], check=True)
    subprocess.run(["git", "-C", str(checkout), "checkout", "-q", "--detach", head.stdout.strip()], check=True)
    log(f"scratch checkout of {head.stdout.strip()[:12]} in {checkout}, cache {cache}")
    daemon = GitDaemon(mirror.parent)
    try:
        tool = Tool(checkout, cache, daemon.url(mirror.name))
        figures = run(tool, mirror, args)
    finally:
        daemon.stop()
        if not args.keep:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(", ".join(f"{k} {v}" for k, v in figures.items() if not isinstance(v, list | dict)))


def run(tool: Tool, mirror: Path, args) -> dict:
    def must(*command: str) -> subprocess.CompletedProcess:
        result = tool(*command)
        if result.returncode != 0:
            raise SystemExit(f"{shlex.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    lock_path = tool.checkout / "reading_notes" / "citations.lock"
    must("fetch")
    before = json.loads(tool("check", "--json").stdout)
    log(f"before: check: {before['checked']} checked, {before['broken']} broken")
    pre = json.loads(lock_path.read_text())
    bump = ["bump", SOURCE, "--ref", args.ref, "--json"]
    first = tool(*bump)
    refused = first.returncode != 0 and "is not on the package index" in first.stderr
    if refused:  # megatron-core's release of the new tag is not installable here: bump without the wheel
        log(f"bump refused at once: {first.stderr.strip()}; again with --distribution none")
    bumped = json.loads((must(*bump, "--distribution", "none") if refused else first).stdout)
    (tool.checkout.parent / "bump.json").write_text(json.dumps(bumped))  # kept with --keep, beside the checkout
    counts = bumped["counts"]
    log(f"bump {SOURCE} -> {args.ref}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    moved_file = sum(
        1 for c in bumped["citations"] if c.get("new_cite") and c.get("path") and c["path"] not in c["cite"]
    )
    tally, done, locked_by_advice, steps = Counter(), set(), set(), []
    rounds, problems = 0, []
    for rounds in range(1, args.rounds + 1):
        report = json.loads(tool("check", "--json").stdout)
        problems = report["problems"]
        log(f"round {rounds}: check: {report['checked']} checked, {report['broken']} problem(s)")
        if not follow(tool, problems, done, tally, locked_by_advice, steps):
            break
    log("verifying the final lock against the pre-bump texts")
    post = json.loads(lock_path.read_text())
    verified, violations = verify(mirror, pre, post, bumped, locked_by_advice)
    left = Counter(s["action"] for s in steps if s["action"] != "run")
    return {
        "ref": args.ref,
        "bump refused for the package index": int(refused),
        "citations before": len(pre["citations"]),
        f"{SOURCE} citations before": sum(k.startswith(f"{SOURCE}:") for k in pre["citations"]),
        "carried unchanged": counts.get("unchanged", 0),
        "carried moved": counts.get("moved", 0),
        "carried changed": counts.get("changed", 0),
        "carried deleted": counts.get("deleted", 0),
        "carried into another file": moved_file,
        "defaults the bump changed or removed": len(bumped.get("defaults", [])),
        "check rounds": rounds,
        "problems after the loop": len(problems),
        "advice followed": tally["advice followed"],
        "of which refused": tally["refused"],
        "locked by advice": verified["locked by advice"],
        "left for a person": left["person"],
        "citations left for a person": len({s["cite"] for s in steps if s["action"] == "person"}),
        "left: environment": left["environment"],
        "left: advice not understood": left["unknown"],
        "citations after": len(post["citations"]),
        "violations": len(violations),
        "violation list": violations,
        "steps": steps,
    }


if __name__ == "__main__":
    main()
