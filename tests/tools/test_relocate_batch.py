"""The pieces between the engine and the files: batches over fetched bytes, and template rewriting."""

from pathlib import Path

from pin_and_cite.core.citation import parse_location
from pin_and_cite.core.notes import calls_in, rewrite_arguments
from pin_and_cite.relocation.reanchor import relocate_batch
from tests.tools.synthetic import BASE, HEADER


def test_batch_answers_in_order_with_per_file_errors():
    files = {
        ("a", "m.py"): BASE.encode(),
        ("b", "m.py"): (HEADER + BASE).encode(),
        ("a", "blob.bin"): b"\xff\xfe\x00",
        ("b", "blob.bin"): b"\xff\xfe\x00",
        ("a", "new.py"): None,
        ("b", "new.py"): b"x = 1\n",
    }
    cites = ["m.py#L17-L19", "blob.bin#L1-L1", "new.py#L1-L1", "m.py::Column", "m.py#L2"]
    answers = relocate_batch([parse_location(c) for c in cites], "a", "b", files)
    assert [(a.status, a.lines, a.reason) for a in answers] == [
        ("moved", (20, 22), None),
        ("error", None, "blob.bin at a is not UTF-8 text; only text files can be cited"),
        ("error", None, "new.py does not exist at a"),
        ("moved", (12, 25), None),
        ("moved", (5, 5), None),
    ]


def test_rewrite_touches_only_the_literals_even_when_new_anchors_equal_old_ones(tmp_path: Path):
    """Two calls on one line whose anchors swap places: positions are found on the original text first,
    so the second rewrite never lands on the first one's result."""
    note = tmp_path / "n.md.j2"
    note.write_bytes(
        b"intro \xc3\xa9\r\n{{ cite('s:p.py#L10-L12') }} and {{ cite(\"s:p.py#L20-L22\") }} 's:p.py#L10-L12'\r\n"
    )
    first, second = calls_in(note, {"cite"})
    out = rewrite_arguments(note, [(first, "s:p.py#L20-L22"), (second, "s:p.py#L30-L32")])
    assert out == (
        b"intro \xc3\xa9\r\n{{ cite('s:p.py#L20-L22') }} and {{ cite(\"s:p.py#L30-L32\") }} 's:p.py#L10-L12'\r\n"
    )
