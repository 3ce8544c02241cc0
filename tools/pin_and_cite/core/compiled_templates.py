"""Compile each template once per change: Jinja's parse and code generation are half of a `check`, and a
template's Python text depends only on its own text, its name, the environment's settings and the code that
compiles it (Jinja, and pin_and_cite.core.sandbox). That text is Python, so it is kept as a
pin_and_cite.core.verified_cache entry: used only when made from the very text just read, under this user's
key. Jinja's bytecode cache (pickled code objects) is never used. The site's theme templates go through it too
(tools/site_hooks.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import jinja2

from pin_and_cite.core import sandbox
from pin_and_cite.core.verified_cache import VerifiedCache, made_from


@functools.cache
def _compiler_version() -> str:
    """What the generated Python depends on besides the template: Jinja and the modules that set it up."""
    digest = hashlib.sha256(jinja2.__version__.encode())
    for module_file in (sandbox.__file__, __file__):
        digest.update(Path(module_file).read_bytes())
    return digest.hexdigest()


def _settings(environment: jinja2.Environment) -> str:
    """What of the environment the generated Python depends on: its class, syntax, extensions and hooks."""
    fields = (
        *("block_start_string", "block_end_string", "variable_start_string", "variable_end_string"),
        *("comment_start_string", "comment_end_string", "line_statement_prefix", "line_comment_prefix"),
        *("trim_blocks", "lstrip_blocks", "newline_sequence", "keep_trailing_newline", "optimized", "is_async"),
    )
    hooks = (environment.autoescape, environment.finalize)
    return json.dumps(
        [
            qualname(type(environment)),
            sorted(environment.extensions),
            [getattr(environment, field) for field in fields],
            [hook if hook is None or isinstance(hook, bool) else qualname(hook) for hook in hooks],
        ]
    )


def qualname(value) -> str:
    """What a setting JSON cannot hold (a class, a hook, a fence's format function) is named by, the same
    between runs: its module and qualified name."""
    return f"{getattr(value, '__module__', '?')}.{getattr(value, '__qualname__', type(value).__qualname__)}"


class CompiledTemplates(jinja2.BaseLoader):
    """`loader`'s templates, their compiled Python text kept under `cache_root`/compiled."""

    def __init__(self, loader: jinja2.BaseLoader, cache_root: Path):
        self.loader = loader
        self.cache = VerifiedCache(cache_root, "compiled")

    def get_source(self, environment, name):
        return self.loader.get_source(environment, name)

    def list_templates(self):
        return self.loader.list_templates()

    def load(self, environment, name, globals=None):
        source, filename, uptodate = self.get_source(environment, name)
        made = made_from("jinja template", _compiler_version(), _settings(environment), name, source)
        python = self.cache.get(made)
        if python is None:
            python = environment.compile(source, name, raw=True)
            self.cache.put(made, python)
        code = compile(python, filename or "<template>", "exec")
        return environment.template_class.from_code(environment, code, globals or {}, uptodate)
