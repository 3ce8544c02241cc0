"""Property-based tests (hypothesis) of what pin-and-cite parses from people and branches: the citation
grammar, the lock and pins.toml loaders, and `relocate`'s stdin. Each input is either answered or refused
with a one-line PinAndCiteError: never a traceback, never a hang. The budgets keep the file to seconds."""

import contextlib
import io
import json
import string
import sys

import pytest
import tomlkit
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pin_and_cite import cli
from pin_and_cite.core import schema
from pin_and_cite.core.citation import parse_location, parse_spec
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.lock import Lock
from pin_and_cite.core.pins import Pins

FAST = settings(
    max_examples=300,
    deadline=500,
    database=None,  # no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
SHA = "a" * 40

# near-misses of the grammar find more than uniform text: every piece of a citation, each maybe wrong
PIECE = st.sampled_from(
    [
        "up",
        "Up",
        "",
        "pkg/mod.py",
        "pkg//mod.py",
        "../x.py",
        "/abs.py",
        ".git/HEAD",
        "a\\b.py",
        "#L",
        "#L0",
        "#L1",
        "#L3-L2",
        "-L",
        "L12",
        "::",
        "::Column.backward",
        "::1bad",
        ":",
        "#",
        " ",
        "\n",
        "\r",
        "\x00",
        "\u202e",
        "99999999999999999999",
        "C:",
        ".",
    ]
)
CITATIONS = st.one_of(
    st.text(max_size=40), st.lists(PIECE, max_size=8).map("".join), st.text(alphabet=string.printable, max_size=40)
)


@pytest.fixture(scope="module", autouse=True)
def loaded_validators():
    """The shape checks compile their validators, and import jsonschema for the first refused file, once per
    process (pin_and_cite.core.schema): do that before the per-input deadlines count."""
    for shape in (schema.LOCK, schema.PINS):
        with contextlib.suppress(PinAndCiteError):
            schema.check([], shape, "warm-up:", "none")


def refused_in_one_line(error: PinAndCiteError) -> None:
    assert str(error) and "\n" not in str(error) and "\r" not in str(error), repr(str(error))


def loads_or_refuses_in_one_line(loader, path, data: bytes) -> None:
    """`loader(path)` of a file holding `data` answers, or raises a one-line PinAndCiteError."""
    path.write_bytes(data)
    try:
        loader(path)
    except PinAndCiteError as error:
        refused_in_one_line(error)


@FAST
@given(CITATIONS)
@example("up:pkg/mod.py#L1-L99999999999999999999")
def test_the_citation_grammar_answers_or_refuses_in_one_line(text):
    for parse in (parse_spec, parse_location):
        try:
            spec = parse(text)
        except PinAndCiteError as error:
            refused_in_one_line(error)
            continue
        assert 1 <= (spec.lines or (1, 1))[0] <= (spec.lines or (1, 1))[1]
        if parse is parse_spec:
            assert parse_spec(str(spec)) == spec  # what the lock writes reads back the same


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)
VALID_LOCK = {
    "version": 1,
    "files": {"up:pkg/mod.py": {"commit": SHA, "blob": SHA, "size": 3, "resolved_from": "git tree"}},
    "citations": {"up:pkg/mod.py#L1-L2": {"lines": [1, 2], "text_sha256": "0" * 64}},
}


@st.composite
def damaged_locks(draw) -> bytes:
    """A valid lock with one value, at any depth, replaced by arbitrary JSON."""
    lock = json.loads(json.dumps(VALID_LOCK))
    node, keys = lock, []
    while isinstance(node, dict) and node and draw(st.booleans()):
        key = draw(st.sampled_from(sorted(node)))
        keys.append(key)
        parent, node = node, node[key]
    if keys:
        parent[keys[-1]] = draw(JSON)
    else:
        lock = draw(JSON)
    return json.dumps(lock).encode()


@FAST
@given(st.one_of(st.binary(max_size=64), damaged_locks(), JSON.map(lambda v: json.dumps(v).encode())))
@example(b"[]")
@example(b"\xff\xfe")
@example(b'{"version": 1, "files": {}, "citations": {"\\r": null}}')  # a key that once broke the line
def test_the_lock_loader_answers_or_refuses_in_one_line(tmp_path, data):
    loads_or_refuses_in_one_line(Lock, tmp_path / "citations.lock", data)


TOML_VALUE = st.one_of(
    st.text(max_size=8),
    st.integers(),
    st.booleans(),
    st.just(SHA),
    st.just("git://127.0.0.1/x"),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def pins_texts(draw) -> bytes:
    """pins.toml-shaped TOML whose names, keys and values are each maybe wrong, or arbitrary bytes."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=64))
    tables = draw(
        st.dictionaries(
            st.sampled_from(["up", "Up", "a b", "", "x.y", "0"]),
            st.dictionaries(st.sampled_from(["url", "commit", "tag", "distribution", "x"]), TOML_VALUE, max_size=5),
            max_size=2,
        )
    )
    top = draw(st.sampled_from(["sources", "source"]))
    doc = {top: tables if draw(st.booleans()) else draw(TOML_VALUE)}
    return tomlkit.dumps(doc).encode()


@FAST
@given(pins_texts())
@example(b'sources = "x"\n')
@example(b"\x80")
def test_the_pins_loader_answers_or_refuses_in_one_line(tmp_path, data):
    loads_or_refuses_in_one_line(Pins, tmp_path / "pins.toml", data)


@pytest.fixture(scope="module")
def warm_cache(history, tmp_path_factory):
    """A cache that already holds both commits' trees and pkg/mod.py, so each example runs without network."""
    cache = tmp_path_factory.mktemp("fuzz-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIN_AND_CITE_CACHE", str(cache))
        assert _relocate(history, "pkg/mod.py#L1-L2\npkg/mod.py::helper\n")[0] == 0
        yield patch


def _relocate(history, stdin: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    stdin_file = io.TextIOWrapper(io.BytesIO(stdin.encode()))  # universal newlines, as a real stdin
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "stdin", stdin_file)
        code = cli.main(["relocate", "--source", history.url, "--from", history.c1, "--to", history.c2, "--json", "-"])
    return code, out.getvalue(), err.getvalue()


@settings(FAST, max_examples=40, deadline=3000)
@given(
    st.lists(
        st.one_of(
            CITATIONS,
            st.sampled_from(
                [
                    "pkg/mod.py#L12-L14",
                    "pkg/mod.py::Column.backward",
                    "pkg/gone.py#L1",
                    "docs/notes.txt#L1-L3",
                    "pkg#L1",
                    "pkg/mod.py/x#L1",
                ]
            ),
        ),
        max_size=6,
    ).map("\n".join)
)
@example("pkg/mod.py#L1\x00-L2\npkg/mod.py::a.b.c\n\n")
def test_relocate_stdin_answers_each_citation_or_refuses_in_one_line(history, warm_cache, stdin):
    code, out, err = _relocate(history, stdin)
    lines = [line for line in io.TextIOWrapper(io.BytesIO(stdin.encode())) if line.strip()]
    if code == 2:
        assert out == "" and err.count("\n") == 1 and err.startswith("pin-and-cite: error: "), err
        return
    assert code in (0, 1) and err == "", err
    answers = json.loads(out)
    assert len(answers) == len(lines)
    assert {a["status"] for a in answers} <= {"unchanged", "moved", "changed", "deleted", "error"}
    assert code == (1 if any(a["status"] == "error" for a in answers) else 0)
