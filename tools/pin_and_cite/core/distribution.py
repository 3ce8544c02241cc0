"""Installed wheels as a source: a release's wheel may ship byte-identical copies of the upstream files it is built
from (pins.toml names it as a source's `distribution`).

A wheel's file is only a candidate: fetch uses it when its git blob SHA equals the lock's, never otherwise.
importlib.metadata (with the email package it reads metadata with) is imported only when a wheel is asked:
a warm `check` never does.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path


@functools.cache
def _files(distribution: str) -> tuple[str, dict[str, Path]] | None:
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None
    return dist.version, {str(f): Path(dist.locate_file(f)) for f in dist.files or ()}


def installed_file(distribution: str, path: str) -> tuple[str, Path] | None:
    """(version, file) of `path` (a repository path) inside the installed distribution, if it ships one."""
    found = _files(distribution)
    if found is None or path not in found[1]:
        return None
    return found[0], found[1][path]


def installed_version(distribution: str) -> str | None:
    """The version of `distribution` this interpreter would import, from the name of its `NAME-VERSION.dist-info`
    folder on sys.path (importlib.metadata would cost a tenth of a warm `check`), or None when it has none."""
    wanted = re.sub(r"[-_.]+", "_", distribution).lower()
    for folder in sys.path:
        try:
            names = os.listdir(folder or ".")
        except OSError:
            continue
        for name in names:
            project, _, version = name.removesuffix(".dist-info").partition("-")
            if name.endswith(".dist-info") and re.sub(r"[-_.]+", "_", project).lower() == wanted:
                return version
    return None
