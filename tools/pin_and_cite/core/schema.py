"""The shapes of reading_notes/citations.lock and pins.toml, checked before anything is used.

A lock or pins file from a contributor's branch is untrusted: a blob "SHA" that is really a path once named a
file outside the cache. So every SHA is exactly 40 lowercase hex digits (maxLength with the pattern: Python's
`$` would let a trailing newline through), every field has its type, and unknown keys are refused. A file
that does not fit gets one line naming the field, never a traceback.

Every run checks with fastjsonschema, which compiles each schema to Python once (milliseconds); only a file
that does not fit imports jsonschema, whose best_match names the field best (importing it costs a tenth of a
second, a fifth of a `check`).
"""

from __future__ import annotations

from collections.abc import Callable

import fastjsonschema

from pin_and_cite.core.errors import PinAndCiteError, printable
from pin_and_cite.core.store import MAX_BLOB_BYTES

SHA = {"type": "string", "maxLength": 40, "pattern": "^[0-9a-f]{40}$", "description": "a full 40-hex SHA"}
SHA_OR_NULL = {**SHA, "type": ["string", "null"], "description": "a full 40-hex SHA or null"}
TEXT_SHA256 = {"type": "string", "maxLength": 64, "pattern": "^[0-9a-f]{64}$", "description": "a hex SHA-256"}
TEXT_SHA256_OR_NULL = {**TEXT_SHA256, "type": ["string", "null"], "description": "a hex SHA-256 or null"}
LINES = {
    "type": "array",
    "items": {"type": "integer", "minimum": 1},
    "minItems": 2,
    "maxItems": 2,
    "description": "[first, last], line numbers from 1",
}
LINES_OR_NULL = {"anyOf": [LINES, {"type": "null"}], "description": "[first, last] or null"}
TEXT = {"type": "string", "maxLength": 4096}  # every string: a 50 MB url once went into every permalink
TEXT_OR_NULL = {**TEXT, "type": ["string", "null"]}
NAME = {"type": "string", "maxLength": 256}


def _record(required: list[str], **properties) -> dict:
    return {"type": "object", "required": required, "properties": properties, "additionalProperties": False}


def _map_of(value: dict) -> dict:
    return {"type": "object", "propertyNames": TEXT, "additionalProperties": value}


LOCKED_FILE = _record(
    ["commit", "blob", "size", "resolved_from"],
    commit=SHA,
    blob=SHA,
    size={"type": "integer", "minimum": 0, "maximum": MAX_BLOB_BYTES},  # it bounds every read of the blob
    resolved_from=NAME,
)
LOCKED_CITATION = _record(["lines", "text_sha256"], lines=LINES, text_sha256=TEXT_SHA256, symbol=TEXT)
RECORDED_FILE = _record(["old_blob", "new_blob"], old_blob=SHA_OR_NULL, new_blob=SHA_OR_NULL)
RECORDED_CHANGE = _record(
    ["status", "old_lines", "old_text_sha256", "new_lines", "new_text_sha256", "new_cite", "cited_at"],
    status={"enum": ["changed", "deleted"]},
    old_lines=LINES,
    old_text_sha256=TEXT_SHA256,
    new_lines=LINES_OR_NULL,
    new_text_sha256=TEXT_SHA256_OR_NULL,
    new_cite=TEXT_OR_NULL,
    cited_at={"type": "array", "items": TEXT},
    new_path=TEXT_OR_NULL,
)
RECORDED_DEFAULT = _record(["old_value", "new_value"], old_value=TEXT, new_value=TEXT_OR_NULL)
BUMP_RECORD = _record(
    ["old_commit", "new_commit", "counts", "files", "changes"],
    old_commit=SHA,
    new_commit=SHA,
    tag=TEXT_OR_NULL,
    counts=_map_of({"type": "integer", "minimum": 0}),
    files=_map_of(RECORDED_FILE),
    changes=_map_of(RECORDED_CHANGE),
    defaults=_map_of(RECORDED_DEFAULT),
    distribution={"type": "string"},
)
PARAMETER_DEFAULT = _record(["value", "line"], value=TEXT, line={"type": "integer", "minimum": 1})

LOCK = _record(
    ["version", "files", "citations"],
    version={"enum": [1]},  # not "const": fastjsonschema cannot compile const without detailed exceptions
    files=_map_of(LOCKED_FILE),
    citations=_map_of(LOCKED_CITATION),
    bumps=_map_of(BUMP_RECORD),
    defaults=_map_of(PARAMETER_DEFAULT),
)

SOURCE = _record(
    ["url", "commit"],
    url={"type": "string", "maxLength": 2048},
    commit=SHA,
    tag=NAME,
    distribution=NAME,
    sha_file={
        "type": "string",
        "maxLength": 256,
        "pattern": "^[A-Za-z0-9][A-Za-z0-9._-]*$",
        "description": "a file name in the notes folder",
    },
)
PINS = _record([], sources=_map_of(SOURCE), site=_record([], plugin=NAME))  # a module: pin_and_cite.site.plugin


_compiled: dict[int, Callable] = {}  # id of a schema above -> its fastjsonschema validator


def fits(data, schema: dict) -> bool:
    """Does `data` fit `schema`, by its compiled validator."""
    if id(schema) not in _compiled:
        # without its detailed messages (jsonschema names the field instead), compiling takes a third the time
        _compiled[id(schema)] = fastjsonschema.compile(schema, detailed_exceptions=False)
    try:
        _compiled[id(schema)](data)
    except fastjsonschema.JsonSchemaException:
        return False
    return True


def check(data, schema: dict, where: str, remedy: str) -> None:
    """Raise PinAndCiteError naming the first field of `data` that does not fit `schema`."""
    if fits(data, schema):
        return
    import jsonschema  # only for a file that does not fit: see the module docstring
    from jsonschema.exceptions import best_match

    error = best_match(jsonschema.Draft202012Validator(schema).iter_errors(data))
    if error is None:
        return
    # a key from the file (a "\r", a newline) must not break the one line: escape what is not printable
    field = printable(error.json_path.removeprefix("$.").removeprefix("$")) or "the top level"
    described = error.schema.get("description") if isinstance(error.schema, dict) else None
    if described and error.validator not in ("required", "additionalProperties"):
        problem = f"{field} {_short(repr(error.instance))} is not {described}"
    else:
        problem = f"{field}: {_short(printable(error.message))}"
    raise PinAndCiteError(f"{where} {problem}; {remedy}")


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."
