"""What a page prints of text it did not write: Markdown code fences and spans for upstream text and
recordings, which may hold backtick runs of any length, and recorded data (traces, calibrations, recorded
output) as page text, in which no `<` opens a tag."""

import re


def _longest_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def fence_for(text: str) -> str:
    """A backtick fence longer than any backtick run inside the text, so no excerpt can close it early."""
    return "`" * max(3, _longest_run(text) + 1)


def code_span(text: str) -> str:
    """`text` (a parameter default as upstream writes it) as one inline code span on one line, fenced the same
    way: a backtick in it must not end the span, or what follows (`<script>`) is live HTML on the page."""
    text = " ".join(text.split())
    fence = "`" * (_longest_run(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def page_text(value, json_text: bytes | None = None):
    """`value` (recorded data: dicts, lists, strings, numbers) with every `<` in its strings written `&lt;`:
    a recorded model name, config value or output line is then text wherever a page prints it (Markdown,
    a table, a heading), never a live `<script>`. The committed recordings hold no `<`, so they read the same.
    Given the JSON text the value was parsed from, a text with no `<` in any spelling returns the value as it
    is, unwalked (a `check` reads the traces 70 times)."""
    if json_text is not None and b"<" not in json_text and b"\\u003c" not in json_text.lower():
        return value
    if isinstance(value, str):
        return value.replace("<", "&lt;")
    if isinstance(value, dict):
        return {page_text(key): page_text(item) for key, item in value.items()}
    if isinstance(value, list):
        return [page_text(item) for item in value]
    return value
