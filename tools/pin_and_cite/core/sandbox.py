"""The one Jinja environment note templates are parsed and rendered in, sandboxed: a template comes from a
contributor's branch, and `check` and the site build render it.

Jinja's ImmutableSandboxedEnvironment refuses every attribute that starts with `_` (so no way leads from a
value to its class, a function's globals, `os`), calls it deems unsafe, and methods that change a list, dict
or set (a note cannot empty `pins` to hide a stale pin from `check`). Jinja's own globals (`cycler`,
`lipsum`, `range`...) are removed: a template sees only the helpers the renderer gives it. Compiled templates
may be kept (CompiledTemplates): the checks run when a template runs, through calls Jinja compiles in only
for a sandboxed environment, so the folder is this environment's alone.
"""

from __future__ import annotations

from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class CompiledTemplates(jinja2.FileSystemBytecodeCache):
    """Templates compiled once and kept under the cache (`<cache>/<folder>/<Jinja version>/`): compiling every
    note is a third of a `check`. Jinja keys each file by the template's path and checks the hash of its
    source, so an edited template is compiled again; a damaged or unwritable file costs a compile, never an
    error. `folder` keeps environments apart: code compiled for the sandbox (the default, "jinja") is never
    loaded into another environment, nor the reverse."""

    def __init__(self, cache_root: Path, folder: str = "jinja"):
        folder = cache_root / folder / jinja2.__version__
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        super().__init__(str(folder))

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # a damaged file: Jinja's own reader only survives some damage
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


def environment(
    loader: jinja2.BaseLoader | None = None, compiled: CompiledTemplates | None = None
) -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        bytecode_cache=compiled,
    )
    env.globals.clear()
    return env
