"""pin_and_cite.core.verified_cache: an entry is read back only when it was made from what the reader names and
carries the MAC of this user's key, so that what a cache holds can be run (compiled templates) or published
(highlighted blocks, a test page's helpers) and a planted entry still changes nothing."""

import json
import os

from pin_and_cite.core.verified_cache import VerifiedCache, made_from
from pin_and_cite.site.evidence_pages import _kept_helpers, _module_helpers

TEST_FILE = "def helper():\n    return 1\n\n\ndef test_x():\n    assert helper() == 1\n"


def test_an_entry_is_read_back_only_for_what_it_was_made_from(tmp_path):
    cache = VerifiedCache(tmp_path, "kind")
    made, other = made_from("a", "text"), made_from("a", "other text")
    cache.put(made, "kept")
    assert VerifiedCache(tmp_path, "kind").get(made) == "kept"  # a new process: from disk
    assert cache.get(other) is None
    [entry] = (tmp_path / "kind").rglob("*.json")
    (tmp_path / "kind" / other[:2]).mkdir(exist_ok=True)
    (tmp_path / "kind" / other[:2] / f"{other[2:]}.json").write_bytes(entry.read_bytes())  # copied to another name
    assert cache.get(other) is None
    entry.write_text(json.dumps({**json.loads(entry.read_text()), "text": "planted"}))
    assert cache.get(made) is None


def test_a_key_that_is_not_this_users_private_file_turns_the_cache_off(tmp_path):
    cache = VerifiedCache(tmp_path, "kind")
    cache.put(made_from("a"), "kept")
    key = tmp_path / "verified.key"
    os.chmod(key, 0o640)
    assert VerifiedCache(tmp_path, "kind").get(made_from("a")) is None
    key.unlink()
    key.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_bytes(b"k" * 32)
    os.chmod(tmp_path / "elsewhere", 0o600)
    assert VerifiedCache(tmp_path, "kind").key() is None


def test_a_test_pages_helpers_are_kept_and_a_planted_set_changes_nothing(tmp_path):
    parsed = _module_helpers(TEST_FILE)
    assert parsed["test_x"][0] == {"helper"}
    assert _kept_helpers(tmp_path, TEST_FILE) == parsed
    assert _kept_helpers(tmp_path, TEST_FILE) == parsed  # read back
    [entry] = (tmp_path / "test-helpers").rglob("*.json")
    stored = json.loads(entry.read_text())
    entry.write_text(json.dumps({**stored, "text": json.dumps([["test_x", [["os"], [0, 0]]]])}))
    assert _kept_helpers(tmp_path, TEST_FILE) == parsed
    assert json.loads(entry.read_text()) == stored


def test_made_from_keeps_parts_apart_and_takes_a_missing_one():
    """A fence without a language hands the highlight cache None: it names an entry of its own, as a part's
    boundaries do (a code block without a language was once rendered as inline code when made_from refused None)."""
    names = {made_from("a", None), made_from("a", "null"), made_from("a", ""), made_from("ab"), made_from("a", "b")}
    assert len(names) == 5
