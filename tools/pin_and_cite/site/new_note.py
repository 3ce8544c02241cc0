"""`new-note NAME --title TITLE`: start a close reading from a skeleton that keeps every structure rule
(pin_and_cite.site.note_rules) except what only its author can fill, so the first `check` is the to-do list.

The guidance sits in Jinja comments, which are neither rendered nor counted as words. The file is written
whole or not at all, and never over an existing note (linked into place, which fails if the name is taken).
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from pin_and_cite.core.atomic import stage
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.site.note_rules import MIN_CHOICES

NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,63}")
CHOICE = """\
### Choice {n}

{{# Rename the heading (a few words: headings count toward the 300). Then 50-80 words: what upstream
   does here and why. Cite the lines, lock them first:
      tools/pin-and-cite cite SOURCE:PATH::Qual.name    (or SOURCE:PATH#La-Lb)
   then show them:  {{{{ cite("SOURCE:PATH::Qual.name", highlight="Lx-Ly") }}}}
   Name the evidence: {{{{ verified_by("tests/reference/test_x.py::test_y") }}}} for a test marked
   @pytest.mark.upstream(SOURCE); where upstream cannot run on CPU, {{{{ reference_only("CUDA-only", "why") }}}}
   beside a reference test. #}}
"""


def skeleton(title: str) -> str:
    choices = "\n".join(CHOICE.format(n=n) for n in range(1, MIN_CHOICES + 1))
    return f"""---
rules: close-reading
description: ""  # one line beside the title in the home page's reading order
---
{{# A close reading: tools/pin_and_cite/site/note_rules.py holds its rules, docs/adding-a-note.md the steps. #}}
# {title}

{choices}
## Connect the dots

{{# A number from a recorded run (reading_notes/traces/, tools/record-traces), never typed:
   {{{{ trace("tp_block").world }}}} ranks; the study's helpers turn traces into estimates (docs/pin-and-cite.md). #}}
"""


def new_note(notes_dir: Path, name: str, title: str) -> Path:
    """Write notes_dir/NAME.md.j2 from the skeleton; refuse a bad or taken name."""
    if not NAME.fullmatch(name):
        raise PinAndCiteError(f"note name {name!r}: use lowercase letters, digits and '-' (e.g. fsdp2-sharding)")
    title = " ".join(title.split())
    if not title or "{" in title or "}" in title:
        raise PinAndCiteError(f"--title {title!r}: give a title without '{{' or '}}' (the note is a Jinja template)")
    path = notes_dir / f"{name}.md.j2"
    tmp = notes_dir / f".{name}.{os.getpid()}.tmp"
    try:
        stage(tmp, path, skeleton(title).encode())
        os.link(tmp, path)  # atomic, and never replaces a note already there
    except FileExistsError:
        raise PinAndCiteError(f"reading_notes/{name}.md.j2 already exists; choose another name") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path
