"""Every bad input gets one clear line on stderr, a meaningful exit code, and leaves nothing half-written."""

import pytest

from tests.gitserver import SilentServer

LAYERS = "up:pkg/core/layers.py"


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope:pkg/core/layers.py#L1-L2", "unknown source 'nope' (pins.toml has: up)"),
        ("up:pkg/core/layers.py#L", "malformed citation"),
        ("up:pkg/core/layers.py", "malformed citation"),
        ("up:pkg/core/layers.py::not-a-name", "is not a dotted Python name"),
        ("up:pkg/core/layers.py#L5-L3", "line range is inverted (L5 > L3)"),
        ("up:pkg/core/layers.py#L0-L2", "line numbers start at 1"),
        ("up:pkg/core/layers.py#L20-L99", "past the end of pkg/core/layers.py at up@"),
        ("up:pkg/core/absent.py#L1-L2", "pkg/core/absent.py does not exist at up@"),
        ("up:pkg/core#L1-L2", "pkg/core does not exist at up@"),
        ("up:pkg/core/layers.py::ColumnParallel.missing", "symbol 'ColumnParallel.missing' is not defined"),
        ("up:pkg/core/layers.py::twice", "symbol 'twice' is ambiguous in pkg/core/layers.py at up@"),
        ("up:../outside.py#L1-L2", "escapes the repository"),
        ("up:/etc/passwd#L1-L2", "must be relative to the repository root"),
        ("up:pkg/.git/config#L1-L2", "names .git"),
    ],
)
def test_cite_refuses_bad_citations(project, spec, message):
    r = project.run("cite", spec)
    assert r.code == 2, r.err
    assert message in r.err
    assert r.err.startswith("pin-and-cite: error: ") and r.err.count("\n") == 1
    assert not project.lock_path.exists()


def test_a_bad_citation_among_good_ones_writes_nothing(project):
    r = project.run("cite", f"{LAYERS}#L9-L10", f"{LAYERS}#L1-L999")
    assert r.code == 2
    assert not project.lock_path.exists()
    assert not list(project.lock_path.parent.glob(".*.tmp"))


@pytest.mark.parametrize(
    "ref, message",
    [
        ("abc1234", "looks like a short SHA; give the full 40-hex commit SHA"),
        ("no-such-tag", "has no tag or branch named 'no-such-tag'"),
        ("0123456789abcdef0123456789abcdef01234567", "has no commit 0123456789abcdef0123456789abcdef01234567"),
    ],
)
def test_pin_refuses_bad_refs(project, ref, message):
    before = project.pins_path.read_text()
    r = project.run("pin", "up", "--ref", ref)
    assert r.code == 2 and message in r.err, r.err
    assert project.pins_path.read_text() == before


def test_pins_with_a_non_hex_commit_are_refused(project, upstream):
    project.write_pins(up={"url": upstream.url, "commit": "v1"})
    r = project.run("check")
    assert r.code == 2 and "commit 'v1' is not a full 40-hex SHA" in r.err


@pytest.mark.parametrize(
    "url", ["ext::sh -c touch% /tmp/pwned", "--upload-pack=touch /tmp/pwned", "fd::17", "not a url"]
)
def test_unsafe_remotes_are_refused(project, url):
    r = project.run("cite", f"{LAYERS}#L9-L10", f"--url=up={url}")
    assert r.code == 2 and "refusing" in r.err and "git URL" in r.err, r.err


def test_unsafe_url_in_pins_is_refused(project, upstream):
    project.write_pins(up={"url": "ext::sh -c id", "commit": upstream.v1})
    r = project.run("cite", f"{LAYERS}#L9-L10")
    assert r.code == 2 and "refusing unsafe git URL" in r.err


def test_unreachable_remote_fails_fast_with_a_clear_line(project, upstream):
    project.write_pins(up={"url": "git://127.0.0.1:9/up.git", "commit": upstream.v1})
    r = project.run("cite", f"{LAYERS}#L9-L10")
    assert r.code == 3
    assert "git://127.0.0.1:9/up.git failed" in r.err and "Connection refused" in r.err
    assert r.err.count("\n") == 1


def test_a_remote_that_never_answers_times_out(project, upstream):
    silent = SilentServer()
    project.write_pins(up={"url": f"git://127.0.0.1:{silent.port}/up.git", "commit": upstream.v1})
    r = project.run("cite", f"{LAYERS}#L9-L10", "--timeout", "2")
    silent.close()
    assert r.code == 3 and "no answer within 2s" in r.err, r.err


def test_installed_file_with_other_bytes_is_never_used(project, upstream):
    project.write_pins(up={"url": upstream.url, "commit": upstream.v1, "distribution": "GitPython"})
    assert project.run("cite", "up:git/__init__.py#L1-L1").code == 0
    import shutil

    shutil.rmtree(project.cache)
    r = project.run("fetch", "--json")
    assert r.code == 0, r.err
    [fetched] = r.json()
    assert fetched["origin"] == upstream.url
    assert "installed GitPython" in fetched["note"] and "other bytes" in fetched["note"]


def test_unknown_mirror_name_is_refused(project):
    r = project.run("fetch", "--url", "nope=git://127.0.0.1/x")
    assert r.code == 2 and "unknown source 'nope'" in r.err
