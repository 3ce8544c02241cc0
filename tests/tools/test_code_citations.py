"""Citations written in the reference's docstrings (pin_and_cite.core.code_citations): `check` verifies them at
their file:line, refuses hand-typed upstream line numbers, and the reference pages render from them."""

from pin_and_cite.core.code_citations import citations_in_text, code_texts, hand_typed_lines
from tests.tools.conftest import FREE_FORM, ROOT

LAYERS = "up:pkg/core/layers.py"
OURS = '''"""Our column-parallel layer."""


class Column:
    """Splits the output dimension.

    Mirrors `{cite}`.
    """
'''


def _reference(project, text: str) -> None:
    (project.root / "reference").mkdir(exist_ok=True)
    (project.root / "reference" / "layers.py").write_text(text)


def test_a_docstring_citation_that_holds_passes_check(project):
    assert project.run("cite", f"{LAYERS}::ColumnParallel").code == 0
    _reference(project, OURS.format(cite=f"{LAYERS}::ColumnParallel"))
    r = project.run("check", "--json")
    assert r.code == 0, r.out + r.err
    assert r.json() == {"checked": 1, "broken": 0, "problems": []}


def test_a_misspelled_symbol_is_one_line_naming_the_docstring(project):
    assert project.run("cite", f"{LAYERS}::ColumnParallel").code == 0
    _reference(project, OURS.format(cite=f"{LAYERS}::ColumnParalel"))
    r = project.run("check")
    assert r.code == 1
    assert (
        f"reference/layers.py:7: {LAYERS}::ColumnParalel: not in the lock; run `tools/pin-and-cite cite` on it"
        in r.out.splitlines()
    )
    assert r.out.rstrip().endswith("1 citation(s) ok, 1 broken"), r.out  # the locked one still holds


def test_a_hand_typed_upstream_line_number_is_reported(project):
    _reference(project, '"""Mirrors layers.py (the column split at line 123, see also L88)."""\n')
    r = project.run("check")
    assert r.code == 1
    assert (
        "reference/layers.py:1: line 123: a hand-typed upstream line number, which nothing keeps true; cite the "
        "code as SOURCE:PATH::Qual.name instead"
    ) in r.out.splitlines()
    assert "reference/layers.py:1: L88: a hand-typed" in r.out


def test_a_hand_typed_upstream_line_range_is_reported_and_a_shape_is_not(project):
    _reference(
        project,
        '"""Mirrors _runtime_utils.py, function for function:\n\n'
        "    root_pre_forward   _root_pre_forward (504-606) + _root_cast_forward_input (610-626)\n"
        "    lazy_init          `_lazy_init`, 112-143; the hook at _runtime_utils.py 1416-1470\n"
        "    not lines          (2-3), (16-32), Llama-2/3-70B, ranks 0-3, tp_size 2-8, descending (606-504)\n"
        '"""\n',
    )
    r = project.run("check", "--json")
    assert r.code == 1
    assert [(p["where"], p["cite"]) for p in r.json()["problems"]] == [
        ("reference/layers.py:3", "504-606"),
        ("reference/layers.py:3", "610-626"),
        ("reference/layers.py:4", "112-143"),
        ("reference/layers.py:4", "1416-1470"),
    ]
    assert r.json()["problems"][0]["message"].startswith("a hand-typed upstream line number, which nothing keeps true")


def test_the_reference_page_renders_what_the_docstring_cites(project):
    assert project.run("cite", f"{LAYERS}::ColumnParallel", f"{LAYERS}::ColumnParallel.forward").code == 0
    _reference(project, OURS.format(cite=f"{LAYERS}::ColumnParallel`\nand `{LAYERS}::ColumnParallel.forward"))
    notes = project.root / "reading_notes"
    (notes / "page.md.j2").write_text(FREE_FORM + '{{ mirrors("reference/layers.py::Column") }}\n')
    (notes / "by_hand.md.j2").write_text(
        FREE_FORM
        + f'{{{{ upstream("{LAYERS}::ColumnParallel") }}}}, {{{{ upstream("{LAYERS}::ColumnParallel.forward") }}}}\n'
    )
    assert project.run("render", "--out", str(project.root / "out")).code == 0
    page = (project.root / "out" / "page.md").read_text()
    assert page == (project.root / "out" / "by_hand.md").read_text()
    assert "`pkg/core/layers.py` L9–L18 · `ColumnParallel`" in page and "· `ColumnParallel.forward`" in page


def test_mirrors_of_a_docstring_citing_nothing_fails_the_render(project):
    _reference(project, OURS.format(cite="nothing upstream"))
    (project.root / "reading_notes" / "page.md.j2").write_text(
        FREE_FORM + '\n{{ mirrors("reference/layers.py::Column") }}\n'
    )
    r = project.run("check")
    assert r.code == 1
    assert (
        "reading_notes/page.md.j2:5: render: mirrors('reference/layers.py::Column'): the docstring of Column "
        "cites no upstream code (SOURCE:PATH::Qual.name)"
    ) in r.out


def test_the_citation_form_is_found_inside_prose_and_backticks():
    text = (
        "Mirrors `pytorch:torch/a/b.py::C.d`, (megatron-lm:megatron/x.py::f). Not a citation: "
        "reference/fsdp/x.py::f, `_runtime_utils.py::_unshard`.\nSee up:p.py::Name."
    )
    assert citations_in_text(text) == [
        ("pytorch:torch/a/b.py::C.d", 1),
        ("megatron-lm:megatron/x.py::f", 1),
        ("up:p.py::Name", 2),
    ]


def test_the_reference_carries_no_hand_typed_upstream_line_number():
    assert hand_typed_lines(code_texts(ROOT), ROOT) == []
