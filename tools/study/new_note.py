"""The skeleton `new-note NAME --title TITLE` starts a close reading from: it keeps every structure rule of this
study's notes (study.note_rules) except what only its author can fill, so the first `check` is the to-do list.

The guidance sits in Jinja comments, which are neither rendered nor counted as words. pin_and_cite writes the
file (pin_and_cite.site.new_note); this study registers the text (study.plugin).
"""

from __future__ import annotations

from study.note_rules import MIN_CHOICES

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
{{# A close reading: tools/study/note_rules.py holds its rules, docs/adding-a-note.md the steps. #}}
# {title}

{choices}
## Connect the dots

{{# A number from a recorded run (reading_notes/traces/, tools/record-traces), never typed:
   {{{{ trace("tp_block").world }}}} ranks; the study's helpers turn traces into estimates (docs/pin-and-cite.md). #}}
"""
