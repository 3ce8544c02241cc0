"""The relocation engine on synthetic edits: every case asserts the exact status and lines.

Pure functions of text, so these run in milliseconds; tests/tools/test_relocate_cli.py drives the same engine
through git histories and the CLI.
"""

import random
import re

import pytest

from pin_and_cite.core import symbols
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.relocation import relocate as relocation
from pin_and_cite.relocation.relocate import relocate
from pin_and_cite.relocation.textmatch import normalized
from tests.tools.synthetic import BASE, HEADER, edited, lines


def reloc(new_text: str, cite, old_text: str = BASE, path: str = "pkg/mod.py"):
    r = relocate(path, lines(old_text), lines(new_text), cite)
    return r.status, r.lines


def test_nothing_changed():
    assert reloc(BASE, (17, 19)) == ("unchanged", (17, 19))
    assert reloc(BASE, "Column.forward") == ("unchanged", (16, 19))


def test_pure_move_shifts_ranges_and_symbols():
    new = HEADER + BASE
    assert reloc(new, (17, 19)) == ("moved", (20, 22))
    assert reloc(new, (1, 32)) == ("moved", (4, 35))
    assert reloc(new, "Column.forward") == ("moved", (19, 22))
    assert reloc(new, "Column") == ("moved", (12, 25))


def test_functions_swapped_follow_their_text():
    helper_def = "def helper(a, b):\n    total = a + b\n    total = total * 2\n    return total\n\n\n"
    new = edited((helper_def, "")) + "\n\n" + helper_def.rstrip("\n") + "\n"
    assert reloc(new, (25, 28)) == ("moved", (29, 32))
    assert reloc(new, "helper") == ("moved", (29, 32))
    assert reloc(new, "other") == ("moved", (25, 26))


def test_edit_inside_the_range_is_changed_at_the_same_place():
    new = edited(("y = y + 1", "y = y + 2"))
    assert reloc(new, (17, 19)) == ("changed", (17, 19))
    assert reloc(new, "Column.forward") == ("changed", (16, 19))
    assert reloc(new, (12, 14)) == ("unchanged", (12, 14))  # the method before is untouched


def test_lines_added_inside_the_range_grow_it():
    new = HEADER + edited(("        y = y + 1\n", "        y = y + 1\n        y = y * 3\n        y = y - 4\n"))
    assert reloc(new, (17, 19)) == ("changed", (20, 24))
    assert reloc(new, "Column.forward") == ("changed", (19, 24))


def test_line_removed_inside_the_range_shrinks_it():
    new = edited(("        y = y + 1\n", ""))
    assert reloc(new, (16, 19)) == ("changed", (16, 18))


def test_edits_right_around_the_range_leave_it_unchanged():
    new = edited(
        ("    def forward(self, x):", "    def forward(self, x, scale=1):"),
        ("        return y\n", "        return y * scale\n"),
    )
    assert reloc(new, (17, 18)) == ("unchanged", (17, 18))
    assert reloc(new, "Column.forward") == ("changed", (16, 19))


def test_lines_inserted_right_before_the_range_move_it():
    new = edited(("    def forward(self, x):\n", "    def forward(self, x):\n        x = x.float()\n"))
    assert reloc(new, (17, 19)) == ("moved", (18, 20))
    assert reloc(new, (16, 19)) == ("changed", (16, 20))


def test_duplicated_block_follows_the_copy_the_diff_aligns():
    twin = "def twin(a, b):\n    total = a + b\n    total = total * 2\n    return total\n"
    old = BASE + "\n\n" + twin  # body of helper (26-28) == body of twin (36-38)
    new = HEADER + old
    assert reloc(new, (26, 28), old_text=old) == ("moved", (29, 31))
    assert reloc(new, (36, 38), old_text=old) == ("moved", (39, 41))


def test_block_copied_elsewhere_keeps_pointing_at_the_original():
    copy = "def early(a, b):\n    total = a + b\n    total = total * 2\n    return total\n\n\n"
    new = edited(("def traced(fn):", copy + "def traced(fn):"))
    assert reloc(new, (26, 28)) == ("moved", (32, 34))
    assert reloc(new, "helper") == ("moved", (31, 34))


def test_identical_copies_with_no_evidence_which_is_meant_are_flagged_changed():
    old = "X = 1\nY = 2\nP = 3\nQ = 4\nR = 5\n"  # the diff aligns P-R and drops X, Y
    new = "P = 3\nQ = 4\nR = 5\nX = 1\nY = 2\nS = 6\nX = 1\nY = 2\n"  # X, Y now twice, not in a function
    r = relocate("script.txt", lines(old), lines(new), (1, 2))
    assert (r.status, r.lines) == ("changed", (4, 5))  # the copy nearest where the diff expects it
    assert r.reason == "2 identical copies at the new commit; check this is the one meant"


def test_duplicate_resolved_by_enclosing_symbol():
    old = "def a():\n    x = 1\n    y = 2\n    return x\n\n\ndef b():\n    x = 1\n    y = 2\n    return y\n"
    new = (
        "def b():\n    x = 1\n    y = 2\n    return y\n\n\ndef c():\n    pass\n\n\n"
        "def a():\n    x = 1\n    y = 2\n    return x\n"
    )
    assert reloc(new, (2, 3), old_text=old) == ("moved", (12, 13))
    assert reloc(new, (8, 9), old_text=old) == ("moved", (2, 3))


def test_function_renamed():
    new = edited(("def helper(a, b):", "def combine(a, b):"))
    assert reloc(new, "helper") == ("changed", (25, 28))
    assert relocate("m.py", lines(BASE), lines(new), "helper").reason == "helper is gone; combine looks like it renamed"
    assert reloc(new, (26, 28)) == ("unchanged", (26, 28))  # the body's text did not change
    assert reloc(new, (25, 28)) == ("changed", (25, 28))


def test_class_renamed_takes_its_methods_along():
    new = HEADER + edited(("class Column:", "class ColumnParallel:"))
    assert reloc(new, "Column") == ("changed", (12, 25))
    assert reloc(new, "Column.forward") == ("changed", (19, 22))
    assert reloc(new, "Column.__init__") == ("changed", (15, 17))


def test_decorator_added_joins_the_symbol_span():
    new = edited(("    def forward(self, x):", "    @functools.cache\n    def forward(self, x):"))
    assert reloc(new, "Column.forward") == ("changed", (16, 20))
    assert reloc(new, (16, 19)) == ("moved", (17, 20))
    assert reloc(new, "Column.backward") == ("moved", (22, 23))


def test_code_deleted():
    new = edited(("def helper(a, b):\n    total = a + b\n    total = total * 2\n    return total\n\n\n", ""))
    assert reloc(new, "helper") == ("deleted", None)
    assert reloc(new, (25, 28)) == ("deleted", None)
    assert reloc(new, "other") == ("moved", (25, 26))
    method_gone = edited(("\n    def backward(self, grad):\n        return grad\n", ""))
    assert reloc(method_gone, (21, 22)) == ("deleted", None)
    assert reloc(method_gone, "Column.backward") == ("deleted", None)


def test_whole_file_rewritten():
    new = "\n".join(f"CONSTANT_{i} = {i * i}" for i in range(40)) + "\n"
    assert reloc(new, (17, 19)) == ("deleted", None)
    assert reloc(new, (1, 32)) == ("deleted", None)
    assert reloc(new, "Column.forward") == ("deleted", None)
    assert reloc("", (17, 19)) == ("deleted", None)  # emptied
    assert reloc("", "Column.forward") == ("deleted", None)


def test_crlf_and_trailing_whitespace_count_as_the_same_text():
    crlf = BASE.replace("\n", "\r\n")
    assert reloc(crlf, (17, 19)) == ("unchanged", (17, 19))
    assert reloc(crlf, "Column.forward") == ("unchanged", (16, 19))
    spaced = BASE.replace("return y\n", "return y   \n").replace("(self, x):\n", "(self, x):\t\n")
    assert reloc(spaced, (16, 19)) == ("unchanged", (16, 19))
    assert reloc(HEADER.replace("\n", "\r\n") + crlf, "Column.forward") == ("moved", (19, 22))
    assert reloc(BASE, (17, 19), old_text=crlf) == ("unchanged", (17, 19))


def test_body_rewritten_inside_the_same_definition_is_changed_not_deleted():
    new = edited(
        (
            "        y = x * 2\n        y = y + 1\n        return y\n",
            "        out = torch.relu(x)\n        out = out.sum()\n        return out\n",
        )
    )
    assert reloc(new, (17, 19)) == ("changed", (17, 19))
    assert reloc(new, "Column.forward") == ("changed", (16, 19))


def test_indentation_change_is_a_change():
    new = edited(("        y = y + 1\n", "            y = y + 1\n"))
    assert reloc(new, (17, 19)) == ("changed", (17, 19))


def test_code_moved_and_edited_is_found_where_it_went():
    block = "def helper(a, b):\n    total = a + b\n    total = total * 2\n    return total\n\n\n"
    new = edited((block, "")).replace(
        "import functools\n", "import functools\n\n\n" + block.replace("total * 2", "total * 3")
    )
    assert reloc(new, (25, 28)) == ("changed", (5, 8))


def test_symbol_defined_twice_at_the_new_commit_is_changed():
    new = BASE + "\n\nif False:\n    def other(a):\n        return -a\n"
    assert reloc(new, "other") == ("changed", (31, 32))


@pytest.mark.parametrize(
    "old, new, cite, reason",
    [
        (BASE, BASE, (30, 40), "L30-L40 is past the end of pkg/mod.py at old (32 lines)"),
        (BASE, BASE, "Column.missing", "symbol 'Column.missing' is not defined in pkg/mod.py at old"),
        (BASE + "def other():\n    pass\n", BASE, "other", "symbol 'other' is ambiguous in pkg/mod.py at old"),
        (BASE, BASE + "def broken(:\n", "Column", "pkg/mod.py is not valid Python at new; cite it by line range"),
        ("def f(:\n", BASE, "f", "pkg/mod.py is not valid Python at old; cite it by line range"),
    ],
)
def test_per_citation_errors(old, new, cite, reason):
    r = relocate("pkg/mod.py", lines(old), lines(new), cite)
    assert (r.status, r.lines) == ("error", None)
    assert r.reason.startswith(reason)


def test_symbols_need_python_but_ranges_work_on_any_text():
    r = relocate("docs/guide.md", lines(BASE), lines(HEADER + BASE), "Column")
    assert (r.status, r.reason) == ("error", "docs/guide.md is not a Python file; cite it by line range")
    assert reloc(HEADER + BASE, (17, 19), path="docs/guide.md") == ("moved", (20, 22))
    assert reloc(HEADER + BASE + "def broken(:\n", (17, 19)) == ("moved", (20, 22))  # unparsable: ranges still work


def test_never_a_silent_wrong_pointer_under_random_edits():
    """Property: whatever the edits, unchanged/moved answers point at exactly the cited text."""
    rng = random.Random(6)
    vocabulary = [f"    x{i} = x{i - 1} + {i % 3}" for i in range(30)] + ["", "    return x", "    pass"]
    answered = {"unchanged": 0, "moved": 0, "changed": 0, "deleted": 0}
    for _ in range(150):
        old = [rng.choice(vocabulary) for _ in range(rng.randint(10, 60))]
        new = list(old)
        for _ in range(rng.randint(1, 8)):
            at = rng.randrange(len(new) + 1)
            action = rng.choice(["insert", "delete", "modify", "move"])
            if action == "insert":
                new[at:at] = [rng.choice(vocabulary) for _ in range(rng.randint(1, 5))]
            elif new and action == "delete":
                del new[at : at + rng.randint(1, 4)]
            elif new and action == "modify" and at < len(new):
                new[at] = new[at] + "  # edited" if rng.random() < 0.5 else rng.choice(vocabulary)
            elif new and action == "move":
                chunk = new[at : at + rng.randint(1, 6)]
                del new[at : at + len(chunk)]
                dest = rng.randrange(len(new) + 1)
                new[dest:dest] = chunk
        for _ in range(5):
            a = rng.randint(1, len(old))
            b = rng.randint(a, min(len(old), a + 8))
            r = relocate("gen.txt", old, new, (a, b))
            answered[r.status] += 1
            if r.status in ("unchanged", "moved"):
                assert normalized(new[r.lines[0] - 1 : r.lines[1]]) == normalized(old[a - 1 : b])
                assert (r.status == "unchanged") == (r.lines == (a, b))
    assert all(answered.values()), answered  # every status was exercised


def test_a_file_past_the_parse_bound_is_refused_before_it_is_parsed(monkeypatch):
    """Python's AST takes about 150 bytes per byte of source (a 19 MB file once took relocate 4.5 GB): a
    symbol in a file over MAX_PARSED_CHARS is one line, and a line range there is relocated by its text."""
    monkeypatch.setattr(symbols, "MAX_PARSED_CHARS", 2000)
    old = ["def f():", "    return 1", ""]
    new = ["import os", ""] + [line for i in range(200) for line in (f"def g{i}():", f"    return {i}", "")] + old
    refused = relocate("m.py", old, new, "f")
    assert refused.status == "error" and re.match(r"m\.py at new is over .* parsed for its definitions", refused.reason)
    assert relocate("m.py", old, new, (1, 2)).lines == (len(new) - 2, len(new) - 1)


def test_a_file_past_the_relocate_bound_is_one_line(monkeypatch):
    """The diff and fuzzy windows take about 40 bytes per byte: a file over MAX_RELOCATED_CHARS is refused
    before they are built."""
    monkeypatch.setattr(relocation, "MAX_RELOCATED_CHARS", 2000)
    new = ["x = 1"] * 1000
    with pytest.raises(PinAndCiteError, match=r"^m\.py at new is over .* more than relocate compares"):
        relocate("m.py", ["x = 1"], new, (1, 1))
