"""Compile each note template once per change: Jinja's parse and code generation are half of a `check`, and
a template's Python text depends only on its own text, its name and the code that compiles it.

The Python text Jinja generates is kept as JSON under the user's cache (which pin_and_cite.core.project keeps
outside every checkout), one entry per (compiler, name, template text) named by their SHA-256, and it is
Python: so an entry is only ever used when it proves both what it stands for and who wrote it. It names the
hash of the template text it was made from, which must be the text just read, and it carries an HMAC-SHA256,
under a key only this user can read (`<cache>/compiled/key`, 0600, made once), of that hash and the Python
text. A planted, copied or damaged entry fails one of the two and is compiled afresh; a key that is not this
user's own private file turns the cache off. Never a pickle or marshalled code: nothing is run to read one.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import os
import stat
from pathlib import Path

import jinja2

from pin_and_cite.core import sandbox
from pin_and_cite.core.atomic import atomic_write

KEY_BYTES = 32
MAX_ENTRY_BYTES = 64 << 20  # a template is at most 16 MiB; Jinja's Python text a few times that


@functools.cache
def _compiler_version() -> str:
    """What the generated Python depends on besides the template: Jinja and the modules that set it up."""
    digest = hashlib.sha256(jinja2.__version__.encode())
    for module_file in (sandbox.__file__, __file__):
        digest.update(Path(module_file).read_bytes())
    return digest.hexdigest()[:16]


def _private_key(folder: Path) -> bytes | None:
    """The cache's key, made on first use; None (no cache) unless it is a regular file of this user that no
    one else can read or write."""
    path = folder / "key"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "wb") as out:
                out.write(os.urandom(KEY_BYTES))
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as key_file:
            info = os.fstat(key_file.fileno())
            mine = stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077
            key = key_file.read(KEY_BYTES + 1)
    except OSError:
        return None
    return key if mine and len(key) == KEY_BYTES else None


class CompiledTemplates(jinja2.BaseLoader):
    """`loader`'s templates, their compiled Python text kept under `cache_root`/compiled (see the module)."""

    def __init__(self, loader: jinja2.BaseLoader, cache_root: Path):
        self.loader = loader
        self.folder = cache_root / "compiled"
        self._key: bytes | None | bool = False  # False: not read yet

    def get_source(self, environment, name):
        return self.loader.get_source(environment, name)

    def list_templates(self):
        return self.loader.list_templates()

    def load(self, environment, name, globals=None):
        source, filename, uptodate = self.get_source(environment, name)
        python = self.python_of(environment, name, source)
        code = compile(python, filename or "<template>", "exec")
        return environment.template_class.from_code(environment, code, globals or {}, uptodate)

    def python_of(self, environment, name: str, source: str) -> str:
        """Jinja's Python text for template `name` holding `source`: a verified entry's, else compiled now."""
        made_from = hashlib.sha256(json.dumps([_compiler_version(), name, source]).encode()).hexdigest()
        key = self.key()
        path = self.folder / _compiler_version() / made_from[:2] / f"{made_from[2:]}.json"
        if key is not None:
            found = _verified(path, made_from, key)
            if found is not None:
                return found
        python = environment.compile(source, name, raw=True)
        if key is not None:
            entry = {"made_from": made_from, "python": python, "mac": _mac(key, made_from, python)}
            try:
                atomic_write(path, json.dumps(entry).encode())
            except OSError:  # a full or read-only cache only costs time
                pass
        return python

    def key(self) -> bytes | None:
        if self._key is False:
            self._key = _private_key(self.folder)
        return self._key


def _mac(key: bytes, made_from: str, python: str) -> str:
    return hmac.new(key, json.dumps([made_from, python]).encode(), hashlib.sha256).hexdigest()


def _verified(path: Path, made_from: str, key: bytes) -> str | None:
    """The entry's Python text when it was made from `made_from` and carries this key's MAC of both."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as entry_file:
            if not stat.S_ISREG(os.fstat(entry_file.fileno()).st_mode):
                return None
            entry = json.loads(entry_file.read(MAX_ENTRY_BYTES + 1))
        python, mac = entry["python"], entry["mac"]
        if entry["made_from"] != made_from or not isinstance(python, str) or not isinstance(mac, str):
            return None
    except (OSError, ValueError, TypeError, KeyError, RecursionError):
        return None
    return python if hmac.compare_digest(mac, _mac(key, made_from, python)) else None
