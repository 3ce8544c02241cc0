"""Highlights hold: a highlight is whole statements of the cited code (render and `check` refuse one that cuts a
statement, naming the line), and `bump` carries each highlight with its citation or reports it for review."""

import ast

import git
import pytest

from pin_and_cite.core.citation import parse_spec
from pin_and_cite.core.context import Context
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.highlights import Statements, checked_highlight
from pin_and_cite.core.locked import locked_excerpt
from pin_and_cite.core.notes import calls_in, rewrite_arguments, written_calls
from pin_and_cite.core.project import Project
from pin_and_cite.core.resolve import Resolver
from tests.tools.conftest import FREE_FORM, ROOT, _write

MOD = "up:pkg/ops.py"
V1 = '''\
"""Stand-in for an upstream module whose highlighted lines move."""
import functools


def reduce(values, group):
    # all-reduce the partial sums
    total = sum(
        values,
        start=0,
    )
    if group:
        total = total * 2
    return total


class Layer:
    def forward(self, x):
        y = x + 1
        # scale
        y = y * 3
        return y

    def backward(self, grad):
        grad = grad * 3
        return grad
'''
# V2: five lines inserted above `reduce` (everything below moves by 5), and forward's `y = y * 3` edited.
V2 = V1.replace("import functools\n", "import functools\nimport operator\n\n\ndef helper():\n    return 0\n").replace(
    "y = y * 3", "y = y * 4"
)
NOTE = (
    FREE_FORM + "# Ops\n\n"
    "{{ cite('" + MOD + "#L5-L13', highlight='L7-L10') }}\r\n"  # the multi-line call: moves
    '{{ cite("' + MOD + '::Layer.backward", highlight = "L24") }}\n'  # in a symbol that moves
    "{{ cite('" + MOD + "::Layer.forward', highlight='L20-L20') }}\n"  # its code changes
    "{{ cite('" + MOD + "#L17-L21',\n        highlight='L18-L18') }}\n"  # citation changes, highlight moves
    "{{ cite('" + MOD + "#L5-L13') }}\n"
)  # no highlight: untouched
AFTER = (
    FREE_FORM + "# Ops\n\n"
    "{{ cite('" + MOD + "#L10-L18', highlight='L12-L15') }}\r\n"
    '{{ cite("' + MOD + '::Layer.backward", highlight = "L29") }}\n'
    "{{ cite('" + MOD + "::Layer.forward', highlight='L25-L25') }}\n"
    "{{ cite('" + MOD + "#L22-L26',\n        highlight='L23-L23') }}\n"
    "{{ cite('" + MOD + "#L10-L18') }}\n"
)
V3 = V1.replace("        # scale\n        y = y * 3\n", "")  # v1 with forward's scaling gone
SPECS = [f"{MOD}#L5-L13", f"{MOD}::Layer.backward", f"{MOD}::Layer.forward", f"{MOD}#L17-L21"]


@pytest.fixture(scope="module")
def ops(daemon, tmp_path_factory):
    work = git.Repo.init(tmp_path_factory.mktemp("highlights-work"))
    actor = git.Actor("Upstream", "upstream@example.com")
    commits = {}
    for name, text in (("v1", V1), ("v2", V2), ("v3", V3)):
        _write(work, {"pkg/ops.py": text.encode(), "docs/notes.txt": b"alpha\nbeta\ngamma\n"})
        commits[name] = work.index.commit(name, author=actor, committer=actor).hexsha
        work.create_tag(name)
    work.clone(daemon.base / "highlights.git", bare=True)
    return daemon.url("highlights.git"), commits


@pytest.fixture
def noted(project, ops):
    url, commits = ops
    project.write_pins(up={"url": url, "commit": commits["v1"], "tag": "v1"})
    note = project.root / "reading_notes" / "ops.md.j2"
    note.write_bytes(NOTE.encode())
    assert project.run("cite", *SPECS).code == 0
    assert project.run("check").code == 0
    return note


def render_error(project, text: str) -> str:
    (project.root / "reading_notes" / "a.md.j2").write_text(FREE_FORM + text)
    r = project.run("render")
    assert r.code == 2 and r.err.count("\n") == 1, r.err
    return r.err.removeprefix("pin-and-cite: error: ").removesuffix(
        "; that page was left as it was, the others rendered\n"
    )


def test_a_highlight_that_cuts_a_statement_is_a_one_line_error_naming_the_line(project, ops):
    url, commits = ops
    project.write_pins(up={"url": url, "commit": commits["v1"]})
    assert project.run("cite", f"{MOD}#L5-L13", "up:docs/notes.txt#L1-L3").code == 0
    cite = "{{ cite('" + MOD + "#L5-L13', highlight='%s') }}\n"
    assert render_error(project, "x\n" + cite % "L7-L8") == (
        f"reading_notes/a.md.j2:5: {MOD}#L5-L13: highlight L7-L8 must end on a statement's last line, and L8 is "
        'in the statement at L7-L10; use highlight="L7-L10"'
    )
    assert render_error(project, cite % "L6-L10") == (
        f"reading_notes/a.md.j2:4: {MOD}#L5-L13: highlight L6-L10 must start on a statement's first line, and L6 "
        'is a comment line; use highlight="L7-L10" or highlight="L5-L13"'
    )
    assert render_error(project, cite % "L12-L13") == (
        f"reading_notes/a.md.j2:4: {MOD}#L5-L13: highlight L12-L13 cuts the statement at L11-L12 in half (it "
        'begins before L12); use highlight="L11-L13" or highlight="L13-L13"'
    )
    good = cite % "L11-L12" + cite % "L7-L10" + "{{ cite('up:docs/notes.txt#L1-L3', highlight='L2-L3') }}\n"
    (project.root / "reading_notes" / "a.md.j2").write_text(FREE_FORM + good)  # not Python: only the range is checked
    assert project.run("render").code == 0
    assert project.run("check").code == 0
    md = (project.root / "docs" / "notes" / "a.md").read_text()
    assert [line for line in md.splitlines() if "hl_lines" in line] == [
        '```python linenums="5" hl_lines="7-8"',
        '```python linenums="5" hl_lines="3-6"',
        '```text linenums="1" hl_lines="2-3"',
    ]


BLOCKS = """\
class Unit:
    @staticmethod
    @traced(
        "forward")
    def forward(x):
        if x:
            return 1
        else:
            y = 2
            return y
        try:
            pass
        except ValueError:
            raise
"""


@pytest.mark.parametrize(
    "highlight, why",
    [
        ("L2-L14", None),
        ("L3-L14", None),
        ("L5-L14", None),  # from either decorator or the def line
        ("L6-L10", None),
        ("L9-L10", None),
        ("L13-L14", None),
        ("L11-L14", None),
        ("L1-L14", None),
        (
            "L5-L10",
            'cuts the statement at L5-L14 in half (it runs past L10); use highlight="L6-L10" or highlight="L5-L14"',
        ),
        (
            "L4-L10",
            "must start on a statement's first line, and L4 is in the decorator at L3-L4; "
            'use highlight="L6-L10" or highlight="L3-L14"',
        ),
        ("L2-L3", 'must end on a statement\'s last line, and L3 is in the decorator at L3-L4; use highlight="L2-L14"'),
        (
            "L7-L10",
            "takes statements from two blocks of the statement at L6-L10 (an else/except/finally line "
            'between them); use highlight="L6-L10" or highlight="L7-L7"',
        ),
        (
            "L8-L10",
            "must start on a statement's first line, and L8 is in the statement at L6-L10; "
            'use highlight="L9-L10" or highlight="L6-L10"',
        ),
        (
            "L10-L12",
            "cuts the statement at L6-L10 in half (it begins before L10); "
            'use highlight="L12-L12" or highlight="L6-L14"',
        ),
    ],
)
def test_whole_statements_of_one_block_at_any_depth(highlight, why):
    statements = Statements.of(ast.parse(BLOCKS), BLOCKS.split("\n"))
    if why is None:
        assert checked_highlight("c", highlight, (1, 14), statements) == tuple(
            int(n) for n in highlight[1:].split("-L")
        )
    else:
        with pytest.raises(PinAndCiteError) as error:
            checked_highlight("c", highlight, (1, 14), statements)
        assert str(error.value) == f"c: highlight {highlight} {why}"


def test_check_reports_a_highlight_that_cuts_a_statement(project, ops):
    url, commits = ops
    project.write_pins(up={"url": url, "commit": commits["v1"]})
    assert project.run("cite", f"{MOD}::Layer.forward").code == 0
    note = project.root / "reading_notes" / "a.md.j2"
    note.write_text(FREE_FORM + "{{ cite('" + MOD + "::Layer.forward', highlight='L19-L21') }}\n")
    for _ in range(2):  # the second from the verdict the first kept (pin_and_cite.core.parse_cache)
        r = project.run("check")
        assert r.code == 1
        assert r.out.splitlines()[0] == (
            f"reading_notes/a.md.j2:4: render: {MOD}::Layer.forward: highlight L19-L21 must start on a statement's "
            'first line, and L19 is a comment line; use highlight="L18-L21" or highlight="L20-L21"'
        )
    assert any("highlight L19-L21" in p.read_text() for p in (project.cache / "parsed").rglob("*.json"))


def test_check_reports_every_problem_in_one_run_rules_highlights_and_renders_alike(project, ops):
    """A note breaking its rules, with two bad highlights and a diagram without a trace: one `check` names all
    four, not the highlights only once the rules pass."""
    url, commits = ops
    project.write_pins(up={"url": url, "commit": commits["v1"]})
    assert project.run("cite", f"{MOD}::Layer.forward", f"{MOD}#L5-L13").code == 0
    (project.root / "reading_notes" / "a.md.j2").write_text(
        "---\nrules: close-reading\n---\n# A\n\n"
        "{{ cite('" + MOD + "::Layer.forward', highlight='L19-L21') }}\n"
        "{{ cite('" + MOD + "#L5-L13', highlight='L8-L9') }}\n"
        "{{ diagram('tp_block', link='NVLink') }}\n"
    )
    r = project.run("check")
    assert r.code == 1
    problems = sorted(r.out.splitlines()[:-1], key=lambda p: int(p.split(":")[1]))
    assert [p.split(": ")[0] for p in problems] == [
        "reading_notes/a.md.j2:1",  # note rules: too few design choices
        "reading_notes/a.md.j2:6",
        "reading_notes/a.md.j2:7",
        "reading_notes/a.md.j2:8",
        "reading_notes/a.md.j2:9",  # note rules: no "Connect the dots"
    ], r.out
    assert r.out.splitlines()[-1] == "2 citation(s) ok, 5 broken"
    assert "highlight L19-L21 must start on a statement's first line" in problems[1]
    assert "highlight L8-L9 must" in problems[2]
    assert "no recorded trace 'tp_block'" in problems[3]


def test_bump_carries_each_highlight_with_its_citation(project, ops, noted):
    url, commits = ops
    r = project.run("bump", "up", "--ref", "v2", "--json")
    assert r.code == 0, r.err
    assert noted.read_bytes() == AFTER.encode()  # every other byte as it was, CRLF and spacing too
    highlights = {
        (h["where"], h["highlight"]): (h["status"], h["new_highlight"], h["review"]) for h in r.json()["highlights"]
    }
    assert highlights == {
        ("reading_notes/ops.md.j2:6", "L7-L10"): ("moved", "L12-L15", None),
        ("reading_notes/ops.md.j2:7", "L24"): ("moved", "L29", None),
        ("reading_notes/ops.md.j2:8", "L20-L20"): (
            "changed",
            "L25-L25",
            "the highlighted code changed; set to the nearest whole statements inside the citation",
        ),
        ("reading_notes/ops.md.j2:9", "L18-L18"): ("moved", "L23-L23", None),
    }
    assert project.run("check").code == 0
    assert project.run("render").code == 0
    md = (project.root / "docs" / "notes" / "ops.md").read_text()
    assert [line for line in md.splitlines() if line.startswith("```python")] == [
        '```python linenums="10" hl_lines="3-6"',
        '```python linenums="28" hl_lines="2-2"',
        '```python linenums="22" hl_lines="4-4"',
        '```python linenums="22" hl_lines="2-2"',
        '```python linenums="10"',
    ]


def test_review_report_counts_highlights_and_names_each_to_review(project, ops, noted):
    r = project.run("bump", "up", "--ref", "v2", "--dry-run")
    assert r.code == 0, r.err
    lines = r.out.splitlines()
    assert lines[2] == "4 highlight(s): 3 carried, 1 to review"
    assert lines[-1] == (
        f'highlight changed: reading_notes/ops.md.j2:8: {MOD}::Layer.forward highlight="L20-L20" '
        '-> highlight="L25-L25": the highlighted code changed; set to the nearest whole statements '
        "inside the citation"
    )


def test_dry_run_writes_nothing_and_reports_the_carried_highlights(project, noted):
    before = noted.read_bytes(), project.lock_path.read_bytes(), project.pins_path.read_bytes()
    r = project.run("bump", "up", "--ref", "v2", "--dry-run", "--json")
    assert r.code == 0, r.err
    assert r.json()["written"] == [] and len(r.json()["highlights"]) == 4
    assert (noted.read_bytes(), project.lock_path.read_bytes(), project.pins_path.read_bytes()) == before


def test_a_highlight_whose_code_is_gone_is_left_as_written_and_reported(project, ops):
    url, commits = ops
    project.write_pins(up={"url": url, "commit": commits["v1"]})
    note = project.root / "reading_notes" / "gone.md.j2"
    note.write_text(FREE_FORM + "{{ cite('" + MOD + "#L16-L21', highlight='L20-L20') }}\n")
    assert project.run("cite", f"{MOD}#L16-L21").code == 0
    r = project.run("bump", "up", "--ref", "v3", "--json")
    assert r.code == 0, r.err
    (h,) = r.json()["highlights"]
    assert (h["status"], h["new_highlight"]) == ("deleted", "L20-L20")
    assert h["review"] == "the highlighted code has no counterpart; left as written"
    assert note.read_text() == FREE_FORM + "{{ cite('" + MOD + "#L16-L19', highlight='L20-L20') }}\n"
    r = project.run("check")  # a highlight left where nothing is: check says so
    assert r.code == 1 and "highlight L20-L20 lies outside the cited L16-L19" in r.out


def test_rewrite_changes_only_the_highlight_literal_of_the_same_call(tmp_path):
    note = tmp_path / "n.md.j2"
    note.write_bytes(
        b"{{ cite('s:p.py#L1-L9') }} {{ cite('s:p.py#L1-L9' ,\r\n highlight = \"L2\") }} "
        b"highlight='L2' {{ cite('s:q.py::f', highlight='L2') }}\r\n"
    )
    plain, lit, symbol = calls_in(note, {"cite"})
    assert (plain.highlight, lit.highlight, symbol.highlight) == (None, "L2", "L2")
    out = rewrite_arguments(note, [(lit, "s:p.py#L5-L13", "L7"), (symbol, "s:q.py::f", "L8-L9")])
    assert out == (
        b"{{ cite('s:p.py#L1-L9') }} {{ cite('s:p.py#L5-L13' ,\r\n highlight = \"L7\") }} "
        b"highlight='L2' {{ cite('s:q.py::f', highlight='L8-L9') }}\r\n"
    )


def test_a_highlight_that_is_not_a_literal_is_refused(tmp_path):
    note = tmp_path / "n.md.j2"
    note.write_text("{% set h = 'L2' %}\n{{ cite('s:p.py#L1-L9', highlight=h) }}\n")
    with pytest.raises(PinAndCiteError, match=r"n.md.j2:2: cite\(\) takes highlight= as a literal string"):
        calls_in(note, {"cite"})


def test_every_shipped_highlight_is_whole_statements(tmp_path, monkeypatch):
    """The shipped notes, against the installed wheels: every highlight keeps to the statements it marks."""
    monkeypatch.setenv("PIN_AND_CITE_CACHE", str(tmp_path))
    project = Project(ROOT)
    resolver = Resolver(project, allow_remote=False)
    problems = []
    for call in written_calls(Context(project.root), {"cite"}):
        if call.highlight:
            key = str(parse_spec(call.argument))
            excerpt = locked_excerpt(project, resolver, key)
            try:
                checked_highlight(key, call.highlight, excerpt.lines, resolver.statements_in(excerpt))
            except PinAndCiteError as exc:
                problems.append(f"{call.where(ROOT)}: {exc}")
    assert problems == []


def highlighted(tmp_path, monkeypatch, note: str, path: str) -> list[str]:
    """The highlighted text of each citation of `path` in the shipped note `note`, from the installed wheels."""
    monkeypatch.setenv("PIN_AND_CITE_CACHE", str(tmp_path))
    project = Project(ROOT)
    resolver = Resolver(project, allow_remote=False)
    texts = []
    for call in written_calls(Context(project.root), {"cite"}):
        if call.file.name == note and call.highlight and f":{path}" in call.argument:
            excerpt = locked_excerpt(project, resolver, str(parse_spec(call.argument)))
            first, last = checked_highlight(
                call.argument, call.highlight, excerpt.lines, resolver.statements_in(excerpt)
            )
            lines = excerpt.text.splitlines()[first - excerpt.lines[0] : last - excerpt.lines[0] + 1]
            texts.append("\n".join(lines))
    return texts


def test_the_dtensor_tables_all_gather_row_shows_megatrons_forward_gather(tmp_path, monkeypatch):
    """The row says Shard(1) -> Replicate is an all-gather: its excerpt is the column kernel's forward gather of
    the sequence-split input (what Megatron's SP column layer runs), not a backward reduce-scatter."""
    monkeypatch.setenv("PIN_AND_CITE_CACHE", str(tmp_path))
    project = Project(ROOT)
    resolver = Resolver(project, allow_remote=False)
    [row] = [
        line for line in (project.notes_dir / "dtensor-tp.md.j2").read_text().splitlines() if "| Shard(1) → Rep" in line
    ]
    spec = row.split('upstream("', 1)[1].split('")', 1)[0]
    text = locked_excerpt(project, resolver, str(parse_spec(spec))).text
    assert "if sequence_parallel:" in text and "dist_all_gather_func(" in text
    assert "reduce_scatter" not in text


def test_the_1f1b_unbatched_round_highlights_both_parity_branches(tmp_path, monkeypatch):
    """The prose says both ends of a round agree: an even rank's first call (send to the next stage) is met by
    the odd neighbour's first call (receive from the previous); both branches are highlighted (the note's other
    highlight of this file, batch_isend_irecv's, holds no isend or irecv)."""
    texts = highlighted(
        tmp_path, monkeypatch, "megatron-pipeline-1f1b.md.j2", "megatron/core/pipeline_parallel/p2p_communication.py"
    )
    calls = [[line.strip() for line in text.splitlines() if "torch.distributed.i" in line] for text in texts]
    assert [c for c in calls if c] == [
        ["send_next_req = torch.distributed.isend(", "recv_prev_req = torch.distributed.irecv("],  # even ranks
        ["recv_prev_req = torch.distributed.irecv(", "send_next_req = torch.distributed.isend("],  # odd ranks
    ]
