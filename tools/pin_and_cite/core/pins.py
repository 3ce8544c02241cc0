"""reading_notes/pins.toml: the upstream sources, each at one full commit SHA.

Edited by people and by `pin`. Read with the standard library's tomllib; tomlkit (slower to import and to
parse) is used only when `pin` rewrites a commit, to keep the file's comments and layout.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pin_and_cite.core import schema
from pin_and_cite.core.atomic import atomic_write
from pin_and_cite.core.bounded import parse, read_file
from pin_and_cite.core.citation import SOURCE_NAME
from pin_and_cite.core.errors import PinAndCiteError

SHA_FILE = re.compile(r"[a-z0-9][a-z0-9._-]*-sha\.txt")  # never pins.toml, the lock, a template or a trace
MAX_BYTES = 1 << 20  # the project's pins.toml holds 881 bytes
SHAPE = "[sources.NAME]: url and commit (a full SHA), optionally tag, distribution, sha_file; [site]: plugin"


@dataclass(frozen=True)
class Source:
    name: str
    url: str
    commit: str
    tag: str | None = None
    distribution: str | None = None  # "name==version" of a wheel that may carry byte-identical files
    sha_file: str | None = None  # reading_notes/NAME-sha.txt, which render keeps holding the commit (SHA_FILE)

    @property
    def distribution_name(self) -> str | None:
        return re.split(r"[=<>!~ ]", self.distribution, maxsplit=1)[0] if self.distribution else None

    def file_url(self, path: str) -> str | None:
        """GitHub-style blob link at the pinned commit, for web URLs; None for local or git:// remotes."""
        if not self.url.startswith(("https://", "http://")):
            return None
        return f"{self.url.removesuffix('/').removesuffix('.git')}/blob/{self.commit}/{path}"

    def permalink(self, path: str, lines: tuple[int, int]) -> str | None:
        url = self.file_url(path)
        return f"{url}#L{lines[0]}-L{lines[1]}" if url else None


class Pins:
    def __init__(self, path: Path):
        self.path = path
        raw = read_file(path, MAX_BYTES, str(path))
        if raw is None:
            raise PinAndCiteError(f"{path} not found; create it with a [sources.NAME] table (url, commit)")
        try:
            self._text = raw.decode("utf-8")
            data = parse(tomllib.loads, self._text, str(path))
        except UnicodeDecodeError as exc:
            raise PinAndCiteError(f"{path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise PinAndCiteError(f"{path} is not valid TOML: {exc}") from None
        schema.check(data, schema.PINS, f"{path}:", SHAPE)
        self.sources = {name: self._source(name, table) for name, table in data.get("sources", {}).items()}
        self.plugin: str | None = data.get("site", {}).get("plugin")  # pin_and_cite.site.plugin loads it
        sha_files = [source.sha_file for source in self.sources.values() if source.sha_file]
        if len(sha_files) != len(set(sha_files)):
            raise PinAndCiteError(f"{path.name}: two sources name the same sha_file; give each its own")

    def _source(self, name: str, table) -> Source:
        """The source of a table that fits schema.PINS (its name is checked here, by the citation grammar's rule)."""
        if not SOURCE_NAME.fullmatch(name):
            raise PinAndCiteError(
                f"{self.path.name} [sources.{name}]: source names are lowercase letters, digits, '.', '_' and '-'"
            )
        if "sha_file" in table and not SHA_FILE.fullmatch(str(table["sha_file"])):
            raise PinAndCiteError(
                f"{self.path.name} [sources.{name}] sha_file: {str(table['sha_file'])[:80]!r} is not a NAME-sha.txt "
                "file name (lowercase letters, digits, '.', '_', '-'); render writes it in reading_notes/"
            )
        return Source(
            name,
            str(table["url"]),
            str(table["commit"]),
            str(table["tag"]) if "tag" in table else None,
            str(table["distribution"]) if "distribution" in table else None,
            str(table["sha_file"]) if "sha_file" in table else None,
        )

    def get(self, name: str) -> Source:
        try:
            return self.sources[name]
        except KeyError:
            known = ", ".join(sorted(self.sources)) or "none"
            raise PinAndCiteError(f"unknown source {name!r} (pins.toml has: {known})") from None

    def set_commit(self, name: str, url: str, commit: str, tag: str | None) -> None:
        """Record a pin (adding the source if new) and write pins.toml atomically."""
        atomic_write(self.path, self.with_commit(name, url, commit, tag))

    def with_commit(self, name: str, url: str, commit: str, tag: str | None) -> bytes:
        """Record a pin in memory and return the new pins.toml (comments and layout kept) without writing it."""
        import tomlkit

        doc = tomlkit.parse(self._text)
        sources = doc.setdefault("sources", tomlkit.table(is_super_table=True))
        table = sources.get(name)
        if table is None:
            table = tomlkit.table()
            table["url"] = url
            sources[name] = table
        table["commit"] = commit
        if tag:
            table["tag"] = tag
        elif "tag" in table:
            del table["tag"]
        self.sources[name] = self._source(name, table)
        self._text = tomlkit.dumps(doc)
        return self._text.encode()

    def with_distribution(self, name: str, distribution: str | None) -> bytes:
        """Set (None: remove) a source's distribution in memory and return the new pins.toml, unwritten."""
        import tomlkit

        doc = tomlkit.parse(self._text)
        table = doc["sources"][name]
        if distribution:
            table["distribution"] = distribution
        elif "distribution" in table:
            del table["distribution"]
        self.sources[name] = self._source(name, table)
        self._text = tomlkit.dumps(doc)
        return self._text.encode()
