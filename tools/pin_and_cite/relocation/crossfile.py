"""Follow citations whose code left their file: into a renamed file, or into another file of the new commit.

This runs after the same-file engine (pin_and_cite.relocation.relocate), only for the citations it could not place in
their own file: `deleted` answers (a file absent at the new commit is an empty file to it), and symbols whose
name is gone from their file (its rename guess stands unless the name or the identical text is found elsewhere).

Where to look, nearest first; each citation stops at the first ring that answers it:
  1. the cited file's directory,  2. its parent, the parent's subdirectories and its own,  3. the rest of the tree.
In these rings only files with the cited file's suffix whose blob differs between the two commits are candidates
(code that moved went into a file that changed), and a directory whose tree is the same at both commits is never
opened, as `git diff` walks two trees. Trees are fetched one request per level, a ring's candidate blobs in one.
  4. Code gone from its file that no changed file holds may have had a second copy all along, in a file the
     commit left unchanged. Every tree of the new commit is listed (no blob read); of the unchanged files, only
     these are read: the modules that an import of the cited definition's name points at (in the cited file
     and the changed files), at most KEPT_FILES per name, and the KEPT_FILES of the cited file's name, then
     nearest to it, per cited file: what is read does not grow with the tree.
     Only identical text (`moved` when once and under the same name) or the same name (`changed`) answers here.

What answers, in a ring:
  - a renamed file: when the cited path is gone, the added file sharing the most lines with it (at least half
    of the larger one, as git's rename detection) becomes the file, and the same-file engine answers there;
  - identical text: one copy among the candidates -> `moved` (a symbol: only where a definition spans exactly
    that text); several -> `changed`, pointing at the first, with a reason naming them;
  - the same qualified name (the symbol's, or the definition enclosing a cited range) defined once -> `changed`
    there (for a range: the most similar lines inside that definition);
  - a similar body (at least 60% alike by tokens, three lines or more) -> `changed`.
`moved`/`unchanged` are never answered for text that is not identical; an answer in another file carries its path.
"""

from __future__ import annotations

import functools
import posixpath
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from pin_and_cite.core import symbols
from pin_and_cite.core.citation import Spec
from pin_and_cite.core.commit_files import LocalBytes, fetch_files
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.remote import Remote
from pin_and_cite.core.resolve import split_lines
from pin_and_cite.core.store import Store
from pin_and_cite.relocation.relocate import MIN_SIMILARITY, RENAMED_SIMILARITY, FilePair, Relocation, definition_kind
from pin_and_cite.relocation.textmatch import (
    LineIndex,
    Span,
    aligned_span,
    best_windows,
    most_similar,
    normalized,
    retained,
    similarity,
)

RENAME_SHARE = 0.5  # a renamed file keeps at least this share of the larger side's lines (git: -M50%)
MIN_FUZZY_LINES = 3  # shorter blocks are too common to be recognized by likeness alone
HIT_SHARE = 0.5  # a file is searched for a similar block only if it has this share of its lines
KEPT_FILES = 32  # unchanged files read per cited file in ring 4: a bound on bytes whatever the tree's size
IMPORT = re.compile(r"^\s*from\s+(\.*[\w.]*)\s+import\s+(\([^)]*\)|[^\n]*)", re.MULTILINE)


@dataclass
class Lost:
    """A citation the same-file engine could not place: what it cited at the old commit."""

    index: int
    spec: Spec
    pair: FilePair
    span: Span  # 0-based, end exclusive, in the old file
    fallback: Relocation  # the same-file answer, kept when nothing better is found elsewhere

    @property
    def rings(self) -> int:
        """How far to look: the whole tree for code gone from its file, the nearest directories for a symbol
        the same-file engine already guessed renamed in place."""
        return 3 if self.fallback.status == "deleted" else 2

    @property
    def block(self) -> list[str]:
        return self.pair.old[self.span[0] : self.span[1]]


class NewFile:
    """A candidate file at the new commit, indexed lazily."""

    def __init__(self, path: str, raw: Sequence[str], added: bool):
        self.path, self.raw, self.added = path, raw, added
        self.lines = normalized(raw)
        self.stripped = {line.strip() for line in self.lines}
        self.text = "\n".join(self.lines)

    @functools.cached_property
    def index(self) -> LineIndex:
        return LineIndex(self.lines)

    @functools.cached_property
    def definitions(self) -> dict[str, list[tuple[int, int]]]:
        """Qualified name -> spans; empty when the file is not Python or does not parse."""
        try:
            return symbols.definitions("\n".join(self.raw) + "\n", self.path)
        except PinAndCiteError:
            return {}


class TwoTrees:
    """The directories of two commits, read on demand: the part of `git diff --find-renames` needed here."""

    def __init__(self, remote: Remote, store: Store, old: str, new: str):
        self.remote, self.store, self.old, self.new = remote, store, old, new
        self.listing: dict[tuple[str, str], dict[str, tuple[str, str]] | None] = {}

    def read(self, dirs: set[str]) -> None:
        """Read `dirs` (and the trees on the way) at both commits: one request per depth for all of them."""
        chains = {(commit, prefix) for commit in (self.old, self.new) for d in dirs for prefix in _prefixes(d)}
        with self.store.lock(f"git {self.remote.url}"):
            roots = {commit: self.remote.root_tree(commit) for commit in (self.old, self.new)}
            for depth in sorted({_depth(p) for _, p in chains}):
                ids = {}
                for commit, prefix in chains:
                    if _depth(prefix) != depth or (commit, prefix) in self.listing:
                        continue
                    oid = roots[commit] if not prefix else self.subtree(commit, prefix)
                    if oid is None:
                        self.listing[(commit, prefix)] = None
                    else:
                        ids[(commit, prefix)] = oid
                self.remote.fetch_objects(sorted(set(ids.values())), "fetching trees near moved code")
                for key, oid in ids.items():
                    self.listing[key] = self.remote.entries(oid)

    def subtree(self, commit: str, path: str) -> str | None:
        parent = self.listing.get((commit, posixpath.dirname(path)))
        oid, kind = (parent or {}).get(posixpath.basename(path), (None, None))
        return oid if kind == "tree" else None

    def changed_subdirs(self, directory: str) -> list[str]:
        """Subdirectories at the new commit whose tree is not the same at the old one."""
        new = self.listing.get((self.new, directory)) or {}
        old = self.listing.get((self.old, directory)) or {}
        return [
            posixpath.join(directory, name)
            for name, (oid, kind) in sorted(new.items())
            if kind == "tree" and old.get(name) != (oid, kind)
        ]

    def changed_files(self, directory: str, suffix: str) -> list[tuple[str, str, bool]]:
        """(path, blob, added) of the regular files with `suffix` whose blob differs from the old commit's."""
        new = self.listing.get((self.new, directory)) or {}
        old = self.listing.get((self.old, directory)) or {}
        return [
            (posixpath.join(directory, name), oid, name not in old)
            for name, (oid, kind) in sorted(new.items())
            if kind == "file" and name.endswith(suffix) and old.get(name) != (oid, kind)
        ]

    def exists_at_new(self, path: str) -> bool:
        listing = self.listing.get((self.new, posixpath.dirname(path))) or {}
        return listing.get(posixpath.basename(path), (None, None))[1] == "file"

    def whole_tree(self, changed_only: bool = True) -> list[str]:
        """Every directory of the new commit (under a tree that changed, unless not `changed_only`), walked one
        level per request."""
        found, frontier = [""], [""]
        while frontier:
            self.read(set(frontier))
            frontier = [sub for d in frontier for sub in (self.changed_subdirs(d) if changed_only else self.subdirs(d))]
            found += frontier
        return found

    def subdirs(self, directory: str) -> list[str]:
        new = self.listing.get((self.new, directory)) or {}
        return [posixpath.join(directory, name) for name, (_, kind) in sorted(new.items()) if kind == "tree"]

    def unchanged_files(self, directory: str, suffix: str) -> dict[str, str]:
        """path -> blob of the regular files with `suffix` that are the same at both commits."""
        new = self.listing.get((self.new, directory)) or {}
        old = self.listing.get((self.old, directory)) or {}
        return {
            posixpath.join(directory, name): oid
            for name, (oid, kind) in sorted(new.items())
            if kind == "file" and name.endswith(suffix) and old.get(name) == (oid, kind)
        }


def _prefixes(directory: str) -> list[str]:
    parts = directory.split("/") if directory else []
    return [""] + ["/".join(parts[:k]) for k in range(1, len(parts) + 1)]


def _depth(directory: str) -> int:
    return directory.count("/") + 1 if directory else 0


def _suffix(path: str) -> str:
    return posixpath.splitext(path)[1]


class CrossFile:
    """Answers, for the citations of one remote between two commits, where code went that left its file."""

    def __init__(self, remote: Remote, store: Store, old: str, new: str, local: LocalBytes | None = None):
        self.trees = TwoTrees(remote, store, old, new)
        self.remote, self.store, self.old, self.new, self.local = remote, store, old, new, local
        self.files: dict[str, NewFile] = {}  # every candidate fetched, by path: bump reads the new text here
        self.blobs: dict[str, str] = {}  # their blob ids at the new commit
        self.renames: dict[tuple[str, tuple[str, ...]], FilePair | None] = {}  # one diff per renamed file
        self.near_unchanged: dict[str, list[str]] = {}  # cited path -> the unchanged files of its name or nearest

    def follow(
        self, specs: list[Spec], answers: list[Relocation], pairs: dict[str, FilePair | str]
    ) -> list[Relocation]:
        """`answers` with each lost citation's answer replaced by what was found in another file."""
        pending = [
            lost
            for lost in (_lost(i, s, a, pairs.get(s.path)) for i, (s, a) in enumerate(zip(specs, answers)))
            if lost is not None
        ]
        answers = dict(enumerate(answers))
        searched: dict[int, set[str]] = {lost.index: set() for lost in pending}
        for number, ring in enumerate((self._ring_1, self._ring_2, self._ring_3), 1):
            answers.update({lost.index: self._not_found(lost) for lost in pending if lost.rings < number})
            pending = [lost for lost in pending if lost.rings >= number]
            if not pending:
                break
            dirs = {lost.index: ring(lost.spec.path) - searched[lost.index] for lost in pending}
            candidates = self._fetch({(d, _suffix(lost.spec.path)) for lost in pending for d in dirs[lost.index]})
            still = []
            for lost in pending:
                searched[lost.index] |= dirs[lost.index]
                files = [
                    f
                    for d in sorted(dirs[lost.index])
                    for f in candidates.get((d, _suffix(lost.spec.path)), [])
                    if f.path != lost.spec.path
                ]  # the engine has looked there already
                found = self._answer(lost, files)
                if found is None:
                    still.append(lost)
                else:
                    answers[lost.index] = found
            pending = still
        kept = self._ring_4(pending)  # only citations of the whole-tree ring are still pending here
        answers.update({lost.index: kept.get(lost.index) or self._not_found(lost) for lost in pending})
        return [answers[i] for i in range(len(specs))]

    # -- where to look --------------------------------------------------------------------------------

    def _ring_1(self, path: str) -> set[str]:
        return {posixpath.dirname(path)}

    def _ring_2(self, path: str) -> set[str]:
        """The parent directory, its subdirectories (the directory's siblings), and the directory's own
        subdirectories (the file's siblings); only those whose tree changed."""
        directory = posixpath.dirname(path)
        around = {directory} | ({posixpath.dirname(directory)} if directory else set())
        self.trees.read(around)
        return around | {sub for d in around for sub in self.trees.changed_subdirs(d)}

    def _ring_3(self, path: str) -> set[str]:
        return set(self._whole_tree)

    @functools.cached_property
    def _whole_tree(self) -> list[str]:
        return self.trees.whole_tree()

    @functools.cached_property
    def _all_dirs(self) -> list[str]:
        return self.trees.whole_tree(changed_only=False)

    def _fetch(self, wanted: set[tuple[str, str]]) -> dict[tuple[str, str], list[NewFile]]:
        """The changed files of each (directory, suffix), fetched in one request for all of them."""
        self.trees.read({d for d, _ in wanted})
        listed = {key: self.trees.changed_files(*key) for key in wanted}
        self._load({path: (oid, added) for files in listed.values() for path, oid, added in files})
        return {key: [self.files[p] for p, _, _ in files if p in self.files] for key, files in listed.items()}

    def _load(self, blobs: dict[str, tuple[str, bool]]) -> None:
        """Read these files (path -> (blob, added)) at the new commit into `files`, in one request."""
        blobs = {path: found for path, found in blobs.items() if path not in self.files}
        data = fetch_files(
            self.remote,
            self.store,
            {self.new: list(blobs)},
            {(self.new, path): oid for path, (oid, _) in blobs.items()},
            self.local,
        )
        for path, (oid, added) in blobs.items():
            try:
                raw = split_lines(data[(self.new, path)], path)
            except PinAndCiteError:
                continue  # not text: nothing can have moved there
            self.files[path], self.blobs[path] = NewFile(path, raw, added), oid

    # -- ring 4: files the commit left unchanged ------------------------------------------------------

    def _ring_4(self, pending: list[Lost]) -> dict[int, Relocation]:
        """Answers for code gone from its file whose other copy lives in a file this commit did not change."""
        if not pending:
            return {}
        unchanged = {  # suffix -> path -> blob
            suffix: {path: oid for d in self._all_dirs for path, oid in self.trees.unchanged_files(d, suffix).items()}
            for suffix in {_suffix(lost.spec.path) for lost in pending}
        }
        chosen = {lost.spec.path: self._kept_candidates(lost, unchanged[_suffix(lost.spec.path)]) for lost in pending}
        self._load({path: (unchanged[_suffix(c)][path], False) for c, paths in chosen.items() for path in paths})
        found = {}
        for lost in pending:
            answer = self._kept_answer(lost, [self.files[p] for p in chosen[lost.spec.path] if p in self.files])
            if answer is not None:
                found[lost.index] = answer
        return found

    def _kept_candidates(self, lost: Lost, unchanged: dict[str, str]) -> list[str]:
        """The unchanged files to read for one citation: those an import of its definition's name points at, and
        those of the cited file's name, then nearest to it; at most KEPT_FILES of each."""
        name = (lost.spec.symbol or lost.pair.enclosing("old", lost.span) or "").split(".")[0]
        cited = lost.spec.path
        modules = self._importing(name, lost.pair) if name and cited.endswith(".py") else set()
        imported = [p for p in unchanged if any(_module_of(p) == m or _module_of(p).endswith("." + m) for m in modules)]
        if cited not in self.near_unchanged:
            self.near_unchanged[cited] = sorted(
                unchanged, key=lambda p: (posixpath.basename(p) != posixpath.basename(cited), _distance(cited, p), p)
            )[:KEPT_FILES]
        return list(dict.fromkeys(imported[:KEPT_FILES] + self.near_unchanged[cited]))

    def _importing(self, name: str, pair: FilePair) -> set[str]:
        """Modules from which the cited file (at either commit) or a changed file imports `name`: where its
        callers now find it."""
        named = re.compile(rf"\b{re.escape(name)}\b")
        imports = _imports(pair.path, pair.old_raw) + _imports(pair.path, pair.new_raw) + self._changed_imports
        return {module for module, names in imports if named.search(names)}

    @functools.cached_property
    def _changed_imports(self) -> list[tuple[str, str]]:
        """(module, imported names) of every `from` import in the changed Python files read so far."""
        return [found for f in list(self.files.values()) if f.path.endswith(".py") for found in _imports(f.path, f.raw)]

    def _kept_answer(self, lost: Lost, files: list[NewFile]) -> Relocation | None:
        """Identical text once, under the cited name (the symbol's, or the definition enclosing the range):
        `moved`; identical text otherwise: `changed`, named for review; else the same name: `changed`."""
        copies = self._copies(lost, files)
        name = lost.spec.symbol or lost.pair.enclosing("old", lost.span)
        if copies:
            f, span, found_name = copies[0]
            where = ", ".join(sorted({c[0].path for c in copies}))
            named = found_name if lost.spec.symbol else _enclosing(f, span)
            if len(copies) == 1 and named == name:
                return _located("moved", f, span, lost, found_name)
            what = (
                f"{len(copies)} identical copies" if len(copies) > 1 else f"identical text as {named or 'module code'}"
            )
            return _located(
                "changed",
                f,
                span,
                lost,
                found_name,
                f"{what} in files this commit did not change ({where}); check this is the one meant",
            )
        return self._same_name(lost, files)

    # -- what answers ---------------------------------------------------------------------------------

    def _answer(self, lost: Lost, files: list[NewFile]) -> Relocation | None:
        if not files:
            return None
        pair = self._renamed(lost, files)
        if pair is not None:
            spec = lost.spec
            answer = pair.relocate_symbol(spec.symbol) if spec.symbol else pair.relocate_range(*spec.lines)
            if answer.status not in ("deleted", "error"):
                return Relocation(
                    answer.status, answer.lines, answer.reason or f"{lost.spec.path} is now {pair.path}", pair.path
                )
        copies = self._copies(lost, files)
        if len(copies) == 1:
            ((f, span, name),) = copies
            return _located("moved", f, span, lost, name)
        if copies:
            f, span, name = copies[0]
            where = ", ".join(sorted({c[0].path for c in copies}))
            return _located(
                "changed",
                f,
                span,
                lost,
                name,
                f"{len(copies)} identical copies in other files ({where}); check this is the one meant",
            )
        found = self._same_name(lost, files) or self._imported_in_its_place(lost, files)
        if found is not None or lost.fallback.status != "deleted":
            return found
        return self._similar(lost, files)

    def _imported_in_its_place(self, lost: Lost, files: list[NewFile]) -> Relocation | None:
        """A method or function the cited file no longer defines, whose name without its class and leading
        underscores the file now imports from a module that defines it once, as a function: `changed`, there
        (a `Block._checkpointed_forward` that became `recompute.checkpointed_forward`, which the block's file
        imports and calls in its place: tests/tools/test_relocate_crossfile.py has the real case)."""
        if not lost.spec.symbol or not lost.spec.path.endswith(".py"):
            return None
        bare = lost.spec.symbol.rsplit(".", 1)[-1].lstrip("_")
        named = re.compile(rf"\b{re.escape(bare)}\b")
        modules = {module for module, names in _imports(lost.spec.path, lost.pair.new_raw) if named.search(names)}
        spans = [
            (f, (a - 1, b))
            for f in files
            if _module_of(f.path) in modules
            for a, b in f.definitions.get(bare, [])
            if definition_kind(f.lines[a - 1 : b]) == "def"
        ]
        if len(spans) != 1:
            return None
        ((f, span),) = spans
        reason = f"{lost.spec.symbol} is gone; {lost.spec.path} now imports {bare} from {f.path} in its place"
        return _located("changed", f, span, lost, bare, reason)

    def _renamed(self, lost: Lost, files: list[NewFile]) -> FilePair | None:
        """The cited file and the file it was renamed to, if it is gone and one of `files` looks renamed from it."""
        key = (lost.spec.path, tuple(f.path for f in files))
        if key not in self.renames:
            renamed = None if self.trees.exists_at_new(lost.spec.path) else _renamed_file(lost.pair.old, files)
            self.renames[key] = renamed and FilePair(
                renamed.path, lost.pair.old_raw, renamed.raw, old_label=self.old[:12], new_label=self.new[:12]
            )
        return self.renames[key]

    def _copies(self, lost: Lost, files: list[NewFile]) -> list[tuple[NewFile, Span, str | None]]:
        """Every exact copy of the cited text (for a symbol: a whole definition), with the definition's name."""
        found = []
        for f in files:
            for start in f.index.find(lost.block):
                span = (start, start + len(lost.block))
                if not lost.spec.symbol:
                    found.append((f, span, None))
                    continue
                names = [n for n, spans in f.definitions.items() if (span[0] + 1, span[1]) in spans]
                if len(names) == 1 and len(f.definitions[names[0]]) == 1:
                    found.append((f, span, names[0]))
        return found

    def _same_name(self, lost: Lost, files: list[NewFile]) -> Relocation | None:
        """The cited symbol, or the definition enclosing the cited range, under the same qualified name."""
        name = lost.spec.symbol or lost.pair.enclosing("old", lost.span)
        if name is None:
            return None
        last = name.rsplit(".", 1)[-1]
        spans = [
            (f, (a - 1, b))
            for f in files
            if f"def {last}(" in f.text or f"class {last}" in f.text
            for a, b in f.definitions.get(name, [])
        ]
        if not spans:
            return None
        if lost.spec.symbol:
            f, span = max(spans, key=lambda s: similarity(lost.block, s[0].lines[slice(*s[1])]))
            reason = (
                f"{name} is now in {f.path}"
                if len(spans) == 1
                else f"{name} is defined {len(spans)} times in other files; the most similar is in {f.path}"
            )
            return _located("changed", f, span, lost, None, reason)
        if len(spans) > 1:
            return None
        f, region = spans[0]
        windows = [aligned_span(lost.block, f.lines, w) for w in best_windows(lost.block, f.lines, region)]
        best = most_similar(lost.block, [f.lines[a:b] for a, b in windows])
        if best is None or retained(lost.block, f.lines[slice(*windows[best])]) < MIN_SIMILARITY:
            return None
        return _located("changed", f, windows[best], lost, None, f"{name} is now in {f.path}")

    def _similar(self, lost: Lost, files: list[NewFile]) -> Relocation | None:
        """The most similar code anywhere in the candidates, when the block is long enough to tell."""
        wanted = {line.strip() for line in lost.block if line.strip()}
        if len(wanted) < MIN_FUZZY_LINES:
            return None
        likely = [f for f in files if len(wanted & f.stripped) >= HIT_SHARE * len(wanted)]
        if lost.spec.symbol:
            kind = definition_kind(lost.block)
            scored = [
                (similarity(lost.block, f.lines[a - 1 : b], RENAMED_SIMILARITY), f.path, name, f, (a - 1, b))
                for f in likely
                for name, spans in f.definitions.items()
                if len(spans) == 1
                for a, b in spans
                if definition_kind(f.lines[a - 1 : b]) == kind
            ]
            scored = [s for s in scored if s[0] >= RENAMED_SIMILARITY]
            if not scored:
                return None
            _, _, name, f, span = max(scored, key=lambda s: s[0])
            return _located(
                "changed",
                f,
                span,
                lost,
                None,
                f"{lost.spec.symbol} is gone from {lost.spec.path}; {name} in {f.path} looks like it",
            )
        windows = [
            (f, aligned_span(lost.block, f.lines, w))
            for f in likely
            for w in best_windows(lost.block, f.lines, (0, len(f.lines)))
        ]
        best = most_similar(lost.block, [f.lines[a:b] for f, (a, b) in windows])
        if best is None:
            return None
        f, span = windows[best]
        if similarity(lost.block, f.lines[span[0] : span[1]], RENAMED_SIMILARITY) < RENAMED_SIMILARITY:
            return None
        return _located(
            "changed", f, span, lost, None, f"similar code in {f.path}; the cited text is gone from {lost.spec.path}"
        )

    def _not_found(self, lost: Lost) -> Relocation:
        if lost.fallback.status == "deleted" and not self.trees.exists_at_new(lost.spec.path):
            return Relocation(
                "deleted",
                None,
                f"{lost.spec.path} does not exist at {self.new[:12]}, and the cited code is not found in another file",
            )
        return lost.fallback


def _lost(index: int, spec: Spec, answer: Relocation, pair: FilePair | str | None) -> Lost | None:
    """The citation as lost, if the same-file engine found no place for it in its own file."""
    if not isinstance(pair, FilePair):
        return None
    if spec.symbol:
        gone = answer.status == "deleted" or (answer.status == "changed" and spec.symbol not in pair.definitions("new"))
        if not gone:
            return None
        first, last = symbols.resolve(pair.definitions("old"), spec.symbol, spec.path)
        return Lost(index, spec, pair, (first - 1, last), answer)
    if answer.status != "deleted":
        return None
    return Lost(index, spec, pair, (spec.lines[0] - 1, spec.lines[1]), answer)


def _enclosing(f: NewFile, span: Span) -> str | None:
    unique = {name: spans for name, spans in f.definitions.items() if len(spans) == 1}
    return symbols.enclosing(unique, (span[0] + 1, span[1]))


def _imports(path: str, raw: Sequence[str]) -> list[tuple[str, str]]:
    """(absolute module, imported names) of each `from` import in a Python file's text."""
    return [(_absolute(module, path), names) for module, names in IMPORT.findall("\n".join(raw))]


def _module_of(path: str) -> str:
    """The dotted module a Python path is imported as (from the tree's root)."""
    dotted = posixpath.splitext(path)[0].replace("/", ".")
    return dotted.removesuffix(".__init__")


def _absolute(module: str, importer: str) -> str:
    """A `from` import's module, relative ones resolved against the importing file's package."""
    dots = len(module) - len(module.lstrip("."))
    if not dots:
        return module
    package = posixpath.dirname(importer).split("/")
    package = package[: len(package) - (dots - 1)] if dots > 1 else package
    return ".".join([p for p in package if p] + ([module[dots:]] if module[dots:] else []))


def _distance(cited: str, path: str) -> int:
    """Steps between two files' directories in the tree."""
    a, b = posixpath.dirname(cited).split("/"), posixpath.dirname(path).split("/")
    common = len(posixpath.commonprefix([a, b]))
    return len(a) + len(b) - 2 * common


def _renamed_file(old: Sequence[str], files: list[NewFile]) -> NewFile | None:
    """The added file that shares the most lines with the old file, if it shares enough to be a rename."""
    old_lines = Counter(line for line in old if line.strip())
    best, best_share = None, RENAME_SHARE
    for f in files:
        if not f.added:
            continue
        new_lines = Counter(line for line in f.lines if line.strip())
        larger = max(sum(old_lines.values()), sum(new_lines.values()), 1)
        share = sum((old_lines & new_lines).values()) / larger
        if share >= best_share:
            best, best_share = f, share
    return best


def _located(
    status: str, f: NewFile, span: Span, lost: Lost, name: str | None, reason: str | None = None
) -> Relocation:
    symbol = name if lost.spec.symbol and name and name != lost.spec.symbol else None
    return Relocation(status, (span[0] + 1, span[1]), reason, f.path, symbol)
