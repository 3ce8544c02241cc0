"""Minimal git transfer: one commit, its path's trees, and the cited blobs — never a clone.

Everything is fetched by object id into a per-URL partial repository in the cache: the commit alone
(`--depth=1 --filter=tree:0`), then only the trees on the cited paths, one level at a time, then the cited
blobs in one request. Objects named explicitly as wants are sent despite the filter, so the wire carries
those objects and nothing else. Servers must allow filters and by-SHA wants (GitHub does; so does
`git daemon` with uploadpack.allowFilter and uploadpack.allowAnySHA1InWant).

Several runs may share one cache: creating the partial repository and every fetch into it happen under the
remote's file lock (git's own `shallow.lock` and `config.lock` make a second writer fail, not wait).
GitPython and filelock are imported by the methods that need them, not with this module: `check` and the site
build, which never fetch, would otherwise spend a tenth of a second importing them.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from pin_and_cite.core.errors import PinAndCiteError, SourceUnavailable
from pin_and_cite.core.gitobj import blob_sha, is_full_sha
from pin_and_cite.core.store import MAX_BLOB_BYTES

if TYPE_CHECKING:
    import git

_SAFE_SCHEMES = ("https://", "http://", "git://", "ssh://", "file://")
_SCP_LIKE = re.compile(r"[A-Za-z0-9._-]+@[A-Za-z0-9.-]+:[^:]")
_HARDENING = [  # no remote helpers that run commands, no prompts, bounded HTTP stalls
    "protocol.ext.allow=never",
    "protocol.fd.allow=never",
    "http.lowSpeedLimit=1000",
    "http.lowSpeedTime=20",
    "fetch.negotiationAlgorithm=noop",
    "core.askPass=true",
    "credential.interactive=false",
]
TAG_CHAIN_LIMIT = 8  # a tag of a tag of ... : how far `commit_of` follows before giving up


def check_url(url: str) -> str:
    """Refuse URLs that make git run commands (`ext::`) or read as options (`--upload-pack=...`)."""
    if url.startswith("-") or "::" in url or any(c in url for c in "\n\r\0"):
        raise PinAndCiteError(f"refusing unsafe git URL {url!r}: use https://, git://, ssh://, file:// or a path")
    if url.startswith(_SAFE_SCHEMES) or _SCP_LIKE.match(url) or Path(url).is_dir():
        return url
    raise PinAndCiteError(f"refusing git URL {url!r}: use https://, git://, ssh://, file:// or an existing directory")


class Remote:
    """One upstream URL and the partial repository that caches what was fetched from it."""

    def __init__(self, url: str, git_dir: Path, timeout: float):
        self.url = check_url(url)
        self.timeout = timeout
        self.git_dir = git_dir
        import filelock  # not with the module (see its docstring)

        self.lock = filelock.FileLock(git_dir.with_name(f"{git_dir.name}.lock"))  # reentrant: nest freely
        self._repo: git.Repo | None = None

    def _run(self, what: str, *args: str, stdin_lines: list[str] | None = None, in_repo: bool = True) -> str:
        """Run one git command with hardened config and a hard time limit; failures become one line."""
        import git

        cmd = git.Git(str(self.repo.git_dir) if in_repo else None)
        argv = ["git", *(arg for option in _HARDENING for arg in ("-c", option)), *args]
        env = {
            "GIT_TERMINAL_PROMPT": "0",
            "GIT_SSH_COMMAND": f"ssh -o BatchMode=yes -o ConnectTimeout={max(1, int(self.timeout))}",
        }
        try:
            if stdin_lines is None:
                return cmd.execute(argv, env=env, kill_after_timeout=self.timeout)
            with tempfile.TemporaryFile() as stdin:
                stdin.write("".join(f"{line}\n" for line in stdin_lines).encode())
                stdin.seek(0)
                return cmd.execute(argv, istream=stdin, env=env, kill_after_timeout=self.timeout)
        except git.GitCommandError as exc:
            raise SourceUnavailable(f"{what} from {self.url} failed: {_one_line(exc.stderr, self.timeout)}") from None

    @property
    def repo(self) -> git.Repo:
        import git
        from git.db import GitDB

        if self._repo is None:
            if not (self.git_dir / "config").exists():
                with self.lock:  # a second run waits, then finds it made
                    if not (self.git_dir / "config").exists():
                        self._init_partial_repository()
            self._repo = git.Repo(self.git_dir, odbt=GitDB)  # pure-Python reads: never a lazy fetch
        return self._repo

    def _init_partial_repository(self) -> None:
        """Configure in a scratch directory, then rename it into place: an interrupted run leaves no
        half-configured repository for the next one to trust."""
        import git

        self.git_dir.parent.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=self.git_dir.parent, prefix=f".{self.git_dir.name}."))
        repo = git.Repo.init(scratch, bare=True)
        with repo.config_writer() as cfg:
            cfg.set_value("core", "repositoryformatversion", "1")
            cfg.set_value("extensions", "partialClone", "origin")
            cfg.set_value('remote "origin"', "url", self.url)
            cfg.set_value('remote "origin"', "promisor", "true")
            cfg.set_value('remote "origin"', "partialclonefilter", "blob:none")
        shutil.rmtree(self.git_dir, ignore_errors=True)  # a leftover without config (an older crash)
        scratch.rename(self.git_dir)

    # -- refs -------------------------------------------------------------------------------------------

    def resolve_ref(self, ref: str) -> str:
        """A tag, branch or full SHA -> the full commit SHA it names on the remote (a tag peeled to its commit)."""
        if is_full_sha(ref):
            return self.commit_of(ref)
        if re.fullmatch(r"[0-9a-fA-F]{40}", ref):
            raise PinAndCiteError(f"{ref!r} has uppercase hex; write the full commit SHA in lowercase")
        listing = self._run(f"listing refs of {ref!r}", "ls-remote", "--", self.url, in_repo=False)
        refs = {name: sha for sha, name in (line.split("\t") for line in listing.splitlines() if "\t" in line)}
        for name in (f"refs/tags/{ref}^{{}}", f"refs/tags/{ref}", f"refs/heads/{ref}", ref):
            if name in refs:
                if not is_full_sha(refs[name]):
                    raise SourceUnavailable(f"{self.url} lists {name} at {refs[name][:80]!r}, not a full SHA")
                return self.commit_of(refs[name])
        if re.fullmatch(r"[0-9a-fA-F]{4,39}", ref):
            raise PinAndCiteError(f"{ref!r} looks like a short SHA; give the full 40-hex commit SHA")
        raise PinAndCiteError(f"{self.url} has no tag or branch named {ref!r}")

    def commit_of(self, oid: str) -> str:
        """The commit `oid` names: itself, or what an annotated tag (or a chain of them) points at; a tree or a
        blob is refused (stored as a pin, it would break every later `cite`, `relocate` and `bump`)."""
        for _ in range(TAG_CHAIN_LIMIT):
            self.fetch_commit(oid)
            kind = self.repo.odb.info(bytes.fromhex(oid)).type.decode()
            if kind == "commit":
                return oid
            if kind != "tag":
                raise PinAndCiteError(f"{oid} is a {kind}, not a commit; pin a commit, tag or branch")
            target = self.read(oid).split(b"\n", 1)[0].split()  # b"object <sha>"
            if len(target) != 2 or not is_full_sha(target[1].decode("ascii", "replace")):
                raise SourceUnavailable(f"{self.url} sent tag {oid} without a target object")
            oid = target[1].decode()
        raise PinAndCiteError(f"{oid} is a chain of more than {TAG_CHAIN_LIMIT} tags; pin its commit")

    # -- objects ----------------------------------------------------------------------------------------

    def has(self, oid: str) -> bool:
        return self.repo.odb.has_object(bytes.fromhex(oid))

    def read(self, oid: str, limit: int = MAX_BLOB_BYTES) -> bytes:
        """An object's bytes, refused unread when it is larger than `limit`: a small repository can hold a
        1.5 GB blob of zeros (packs compress), which would otherwise be read whole into memory."""
        size = self.repo.odb.info(bytes.fromhex(oid)).size
        if size > limit:
            raise SourceUnavailable(
                f"{self.url}: object {oid[:12]} is {size} bytes, more than the {limit} bytes allowed "
                f"(the lock's size for it, else {MAX_BLOB_BYTES >> 20} MiB)"
            )
        return self.repo.odb.stream(bytes.fromhex(oid)).read()

    def _missing(self, oids: list[str]) -> list[str]:
        """Those of `oids` not in the partial repository, counting what another run fetched meanwhile."""
        missing = sorted({oid for oid in oids if not self.has(oid)})
        if missing:
            self.repo.odb.update_cache(force=True)
            missing = [oid for oid in missing if not self.has(oid)]
        return missing

    def fetch_commit(self, commit: str) -> None:
        """Fetch one object by id with no history and no trees (a commit, or the tag or other object a ref
        names, which commit_of then inspects)."""
        if self.has(commit):
            return
        with self.lock:
            if self._missing([commit]):
                try:
                    self._run(
                        f"fetching commit {commit[:12]}",
                        "fetch",
                        "--depth=1",
                        "--filter=tree:0",
                        "--no-tags",
                        "--no-write-fetch-head",
                        "--",
                        "origin",
                        commit,
                    )
                except SourceUnavailable as exc:
                    if "not our ref" in str(exc) or "no such remote ref" in str(exc):
                        raise PinAndCiteError(f"{self.url} has no commit {commit}") from None
                    raise
                self.repo.odb.update_cache(force=True)
        if not self.has(commit):
            raise PinAndCiteError(f"{self.url} has no commit {commit}")

    def fetch_objects(self, oids: list[str], what: str) -> None:
        """Fetch exactly these objects (trees or blobs) by id, in one request."""
        if all(self.has(oid) for oid in oids):
            return
        with self.lock:
            missing = self._missing(oids)
            if missing:
                self._run(
                    what,
                    "fetch",
                    "--filter=tree:0",
                    "--no-tags",
                    "--no-write-fetch-head",
                    "--stdin",
                    "origin",
                    stdin_lines=missing,
                )
                self.repo.odb.update_cache(force=True)
                absent = [oid for oid in missing if not self.has(oid)]
                if absent:
                    raise SourceUnavailable(f"{self.url} did not send {len(absent)} object(s), e.g. {absent[0][:12]}")

    def fetch_blobs(self, oids: list[str], what: str, sizes: dict[str, int] | None = None) -> dict[str, bytes]:
        """Fetch these blobs in one request; return their bytes, each proven by its git hash and read no
        further than its size in `sizes` (the lock's), else MAX_BLOB_BYTES."""
        self.fetch_objects(oids, what)
        found = {}
        for oid in oids:
            data = self.read(oid, (sizes or {}).get(oid, MAX_BLOB_BYTES))
            if blob_sha(data) != oid:
                raise SourceUnavailable(f"{self.url} sent bytes that do not hash to {oid}")
            found[oid] = data
        return found

    def root_tree(self, commit: str) -> str:
        self.fetch_commit(commit)
        return self.read(commit).split(b"\n", 1)[0].split()[1].decode()  # "tree <sha>"

    def entries(self, tree: str) -> dict[str, tuple[str, str]]:
        """A fetched tree's entries: name -> (object id, kind), kind being "tree", "file" (a regular file's
        blob), "link" (a symlink's blob) or "commit" (a submodule)."""
        from git.objects.fun import tree_entries_from_data

        kinds = {0o04: "tree", 0o10: "file", 0o12: "link", 0o16: "commit"}
        return {
            name: (binsha.hex(), kinds.get(mode >> 12, "other"))
            for binsha, mode, name in tree_entries_from_data(self.read(tree))
        }

    def blob_ids(self, commit: str, paths: list[str]) -> dict[str, str | None]:
        """Each path's blob id at `commit` (None when the path is absent), walking only the trees needed."""
        root = self.root_tree(commit)
        pending = {path: (root, path.split("/")) for path in paths}
        found: dict[str, str | None] = {}
        while pending:
            self.fetch_objects([tree for tree, _ in pending.values()], f"fetching trees at {commit[:12]}")
            advanced = {}
            for path, (tree, parts) in pending.items():
                oid, kind = self.entries(tree).get(parts[0], (None, None))
                if oid is None or (kind == "tree") != (len(parts) > 1):
                    found[path] = None
                elif len(parts) == 1:
                    found[path] = oid
                else:
                    advanced[path] = (oid, parts[1:])
            pending = advanced
        return found


def _one_line(stderr: str | bytes | None, timeout: float) -> str:
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else (stderr or "")
    if "did not complete in" in text:
        return f"no answer within {timeout:g}s (raise --timeout, or use --url NAME=MIRROR)"
    lines = [ln.strip() for ln in text.replace("stderr:", "").splitlines() if ln.strip().strip("'")]
    fatal = [ln for ln in lines if "fatal:" in ln or "errno" in ln or "error:" in ln]
    return " ".join((fatal or lines or ["git exited with an error"])[-2:]).strip("' ")
