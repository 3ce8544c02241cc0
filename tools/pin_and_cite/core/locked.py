"""A locked citation or default, proven to say what citations.lock says: what `check` verifies and `render`
shows (both import it; neither imports the other back)."""

from __future__ import annotations

from pin_and_cite.core.citation import parse_spec
from pin_and_cite.core.defaults import DefaultRef, FoundDefault
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.lock import file_key
from pin_and_cite.core.project import Project
from pin_and_cite.core.resolve import Excerpt, Resolver


def locked_excerpt(project: Project, resolver: Resolver, key: str) -> Excerpt:
    """The excerpt of the locked citation `key`, proven to say what the lock says; PinAndCiteError says why not."""
    locked = project.lock.citations[key]
    spec = parse_spec(key)
    source = project.pins.get(spec.source)
    entry = project.lock.files.get(file_key(spec.source, spec.path))
    if entry is None:
        raise PinAndCiteError("its file is missing from the lock")
    if entry.commit != source.commit:
        raise PinAndCiteError(
            f"locked at {entry.commit[:12]} but pins.toml now pins {source.commit[:12]}; re-lock after moving a pin"
        )
    excerpt, _ = resolver.resolve(spec)
    if excerpt.lines != tuple(locked.lines):
        raise PinAndCiteError(
            f"symbol now spans L{excerpt.lines[0]}-L{excerpt.lines[1]}, lock says L{locked.lines[0]}-L{locked.lines[1]}"
        )
    if excerpt.text_sha256 != locked.text_sha256:
        raise PinAndCiteError("cited text differs from the lock's hash")
    return excerpt


def locked_default(project: Project, resolver: Resolver, ref: DefaultRef) -> tuple[FoundDefault, Excerpt]:
    """The default `ref` names, proven to be what the lock says, with the excerpt of its declaring symbol."""
    locked = project.lock.defaults.get(str(ref))
    if locked is None:
        if left := project.lock.left_by_bump(str(ref)):  # the advice check and cite give: never lock it again
            raise PinAndCiteError(left)
        raise PinAndCiteError(
            f"{ref} is not in the lock; run `tools/pin-and-cite cite --default {ref.param} {ref.spec}`"
        )
    found, excerpt, _ = resolver.resolve_default(ref)
    if (found.value, found.line) != (locked.value, locked.line):
        raise PinAndCiteError(
            f"the default is now {ref.param}={found.value} at L{found.line}; the lock says "
            f"{ref.param}={locked.value} at L{locked.line}"
        )
    return found, excerpt
