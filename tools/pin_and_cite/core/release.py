"""Which release of a source's wheel the upstream tests run, kept the same as the commit the notes cite.

pins.toml's `distribution = "NAME==VERSION"` is the wheel the upstream-evidence tests install (constraints.txt
at the project root pins it for pip). A release tag names its version at its end (`core_v0.19.0`, `v2.13.0`):
that is the whole rule, applied offline, so `bump` to such a tag moves both to `NAME==X.Y.Z`, and `check` fails
when the pin, the distribution and constraints.txt disagree. A pin no tag maps (a SHA, a branch) counts only
when its bump was told the release (`bump --distribution`), as the lock's bump record says.
"""

from __future__ import annotations

import re
import sys

from pin_and_cite.core.distribution import installed_version
from pin_and_cite.core.pins import Source
from pin_and_cite.core.project import Project
from pin_and_cite.core.regular_file import read_regular

CONSTRAINTS = "constraints.txt"
MAX_CONSTRAINTS = 1 << 20
_VERSION_AT_END = re.compile(r"(\d+(?:\.\d+)+)$")


def pinned_version(distribution: str | None) -> tuple[str, str] | None:
    """(name, version) of `NAME==VERSION`; None for anything else (a bare name pins nothing)."""
    name, sep, version = (distribution or "").partition("==")
    return (name.strip(), version.strip()) if sep and name.strip() and version.strip() else None


def released(distribution: str | None, tag: str | None) -> str | None:
    """`NAME==VERSION` of the release tag `tag` names, for a source whose wheel is `distribution`."""
    pinned, match = pinned_version(distribution), _VERSION_AT_END.search(tag or "")
    return f"{pinned[0]}=={match[1]}" if pinned and match else None


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _constraint(line: str) -> tuple[str, str] | None:
    return pinned_version(line.split("#", 1)[0].split(";", 1)[0])


def with_constraint(text: str, old: str, new: str) -> str:
    """constraints.txt with the line pinning `old`'s wheel pinning `new` instead (other lines as they were)."""
    name = _normal(pinned_version(old)[0])
    lines = text.splitlines(keepends=True)
    for n, line in enumerate(lines):
        if (found := _constraint(line)) and _normal(found[0]) == name:
            lines[n] = f"{new}\n" if line.endswith("\n") else new
    return "".join(lines)


def _cites_release(project: Project, name: str, source: Source) -> bool:
    if released(source.distribution, source.tag) == source.distribution:
        return True
    record = project.lock.bumps.get(name)
    return bool(record and record.new_commit == source.commit and record.distribution == source.distribution)


def stale_distributions(project: Project) -> list[tuple[str, str, str]]:
    """(where, source, why) for each source whose wheel is not the release of its pin, each constraint that
    pins another version of a source's wheel than pins.toml, and each wheel a bump moved that this environment
    has not installed (only then: a user's own torch, with no bump of it, is theirs to run)."""
    problems = []
    data = read_regular(project.root / CONSTRAINTS, MAX_CONSTRAINTS)
    constraints = [c for line in (data or b"").decode("utf-8", "replace").splitlines() if (c := _constraint(line))]
    for name, source in sorted(project.pins.sources.items()):
        pinned = pinned_version(source.distribution)
        if pinned is None:
            continue
        if not _cites_release(project, name, source):
            at = f"{source.commit[:12]}" + (f" ({source.tag})" if source.tag else "")
            problems.append(
                (
                    "reading_notes/pins.toml",
                    name,
                    f"the upstream tests run {source.distribution} but the notes cite {at}, which is not that "
                    "release; bump with --distribution NAME==VERSION (or none)",
                )
            )
        bump = project.lock.bumps.get(name)
        installed = installed_version(pinned[0]) if bump and bump.distribution == source.distribution else None
        if installed is not None and installed.split("+")[0] != pinned[1]:  # 2.13.0+cpu: torch 2.13.0's CPU build
            problems.append(
                (
                    CONSTRAINTS,
                    name,
                    f"the bump to {bump.tag or bump.new_commit[:12]} pins {source.distribution}, but this "
                    f"environment still has {pinned[0]}=={installed}, so the upstream tests run another release "
                    "than the notes cite; install the pinned one (`make setup`, or pip install -c constraints.txt)",
                )
            )
        for other, version in constraints:
            if _normal(other) == _normal(pinned[0]) and version != pinned[1]:
                problems.append(
                    (
                        CONSTRAINTS,
                        name,
                        f"the upstream tests run {other}=={version} but the notes cite {source.distribution} "
                        "(pins.toml); make them agree",
                    )
                )
    return problems


def on_the_index(distribution: str) -> bool | None:
    """Whether pip, as this environment configures it, finds the release `NAME==VERSION` on its package index
    (`pip index versions --pre NAME`): False when it lists other versions or none, None when pip gives no
    answer (not installed, no index reachable)."""
    import subprocess  # here: only a bump that moves a wheel asks

    name, version = pinned_version(distribution) or (distribution, "")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", "--pre", name],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if "No matching distribution" in done.stderr:
        return False
    listed = re.search(r"Available versions: (.*)", done.stdout)
    return None if listed is None else version in [v.strip() for v in listed[1].split(",")]
