"""The one Jinja environment note templates are parsed and rendered in, sandboxed: a template comes from a
contributor's branch, and `check` and the site build render it.

Jinja's ImmutableSandboxedEnvironment refuses every attribute that starts with `_` (so no way leads from a
value to its class, a function's globals, `os`), calls it deems unsafe, and methods that change a list, dict
or set (a note cannot empty `pins` to hide a stale pin from `check`). Jinja's own globals (`cycler`,
`lipsum`, `range`...) are removed: a template sees only the helpers the renderer gives it. Nothing compiled
is kept between runs: Jinja's bytecode cache unpickles its files, and a cache a branch can reach would run
the branch's code (compiling costs a `check` about 0.1 s).
"""

from __future__ import annotations

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def environment(loader: jinja2.BaseLoader | None = None) -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.globals.clear()
    return env
