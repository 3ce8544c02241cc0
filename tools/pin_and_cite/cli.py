"""The command line: a verb per subcommand, `--json` for scripts, exit codes that mean something."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

from pin_and_cite.check import check
from pin_and_cite.core.citation import parse_spec
from pin_and_cite.core.defaults import default_ref
from pin_and_cite.core.errors import LOCAL_IO, PinAndCiteError, printable
from pin_and_cite.core.fetch import Fetched, fetch_all
from pin_and_cite.core.gitobj import is_full_sha
from pin_and_cite.core.project import NOTES_DIR, Project, find_root
from pin_and_cite.core.remote import check_url
from pin_and_cite.core.resolve import Resolver
from pin_and_cite.core.write_lock import write_lock
from pin_and_cite.relocation import bump, journal, review
from pin_and_cite.relocation.reanchor import relocate_texts
from pin_and_cite.site.new_note import new_note
from pin_and_cite.site.output_folder import refuse_symlinked
from pin_and_cite.site.plugin import load_plugin
from pin_and_cite.site.render import SITE_NOTES, render_notes

EPILOG = """\
citations:
  SOURCE:PATH#Lstart-Lend   lines start..end (1-based, inclusive) of PATH at SOURCE's pinned commit
  SOURCE:PATH::Qual.name    the class or function Qual.name, from its first decorator to its last line

relocation statuses (relocate, bump):
  unchanged  same lines, same text          moved    the same text at other lines
  changed    the code is still there but its text differs (or which identical copy is meant is unclear):
             `lines` is its best new location; review it
  deleted    no counterpart at the new commit (nor in another file)
  error      the citation cannot be answered (path absent, not Python, unparsable...): see `reason`
  Lines are compared ignoring trailing whitespace. unchanged/moved are only answered for identical text.
  Code that left its file is followed into a renamed file or another file: the answer then names its path.

exit status:
  0 ok; 1 check found broken citations, or relocate could not answer some citation; 2 bad input
  (arguments, pins, notes, unknown commits); 3 a source could not deliver verified bytes (network, timeout,
  hash mismatch); 4 a local file could not be read or written (disk full, permissions: nothing is left
  half-written); 130 interrupted (nothing is left half-written)

files:
  reading_notes/pins.toml        the sources: url, full commit SHA, optional tag and distribution; and
                                 [site] plugin, the module beside pin_and_cite that gives the notes' helpers,
                                 their rules and new-note's skeleton
  reading_notes/citations.lock   per cited file its git blob SHA, per citation its lines and text hash, per
                                 source the record of its latest bump (changed/deleted citations: lines,
                                 text hashes, blobs at both commits, where the notes cite them)
  reading_notes/**/*.md.j2       note templates, rendered into docs/notes/ (names starting with _ are partials)
  docs/notes/changes/            a page per citation the latest bump changed or deleted, and an index
  reading_notes/NAME-sha.txt     a source's pinned commit (its sha_file in pins.toml), written by render,
                                 verified by check
  reading_notes/.pin-and-cite.lock
                                 the write lock that pin, cite, bump and render hold (git ignores it)
  cache                          $PIN_AND_CITE_CACHE (absolute, outside the project and the current
                                 checkout), else the user cache dir: blobs by SHA, partial repos
"""


def _url_override(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


MAX_TIMEOUT = 86400  # a day: beyond it, nothing is waiting for an answer (and timers overflow)


def _seconds(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not (0 < seconds <= MAX_TIMEOUT):
        raise argparse.ArgumentTypeError(f"expected seconds in (0, {MAX_TIMEOUT}], got {text!r}")
    return seconds


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a refused argument is one line (`pin-and-cite VERB: error: ...`), exit 2 like all bad input."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    network = argparse.ArgumentParser(add_help=False)
    network.add_argument(
        "--timeout",
        type=_seconds,
        default=60.0,
        metavar="SECONDS",
        help="give up on a git remote that does not answer within this many seconds "
        f"(more than 0, at most {MAX_TIMEOUT}; default 60)",
    )
    network.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    located = argparse.ArgumentParser(add_help=False)
    located.add_argument(
        "--project", type=Path, help="project root (default: nearest parent with reading_notes/pins.toml)"
    )
    common = argparse.ArgumentParser(add_help=False, parents=[network, located])
    common.add_argument(
        "--url",
        dest="urls",
        action="append",
        type=_url_override,
        default=[],
        metavar="NAME=URL",
        help="fetch source NAME from URL instead of its pinned url (a mirror); repeatable",
    )

    parser = _OneLineParser(
        prog="pin-and-cite",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EPILOG,
        description="Pin upstream repositories at exact commits, fetch only the cited files (verified by git "
        "blob hash), and check that every citation in the reading notes still says what it claims.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    pin = verbs.add_parser(
        "pin",
        parents=[common],
        help="resolve a tag, branch or full SHA and record it in pins.toml",
        description="Resolve REF on the source's remote to a full commit SHA and record it.",
    )
    pin.add_argument("source", help="source name in pins.toml (or a new one, with --source-url)")
    pin.add_argument("--ref", required=True, help="tag, branch or full 40-hex commit SHA")
    pin.add_argument("--source-url", help="git URL of a new source")
    pin.add_argument(
        "--force",
        action="store_true",
        help="move a pin even though citations are locked at the old commit (`bump` re-anchors them)",
    )

    verbs.add_parser(
        "fetch",
        parents=[common],
        help="materialize every locked file, verified, into the cache",
        description="Get every file in the lock (with both ends of each recorded bump) from the "
        "cache, an installed distribution, or one partial git fetch per source, "
        "verifying each against its git blob SHA.",
    )

    cite = verbs.add_parser(
        "cite",
        parents=[common],
        help="print cited lines with a permalink, and lock them",
        description="Resolve citations at the pinned commit, print them with upstream line "
        "numbers and a permalink, and record them in the lock.",
    )
    cite.add_argument("specs", nargs="+", metavar="CITATION")
    cite.add_argument("--no-lock", action="store_true", help="print only; leave the lock unchanged")
    cite.add_argument(
        "--default",
        metavar="PARAM",
        action="append",
        help="lock the default of parameter PARAM (repeatable) as written in each CITATION (SOURCE:PATH::Qual.name: "
        "a function's signature or a dataclass field), for the notes' default(CITATION, PARAM)",
    )
    cite.add_argument(
        "--rewritten",
        action="store_true",
        help="lock a span the source's last bump deleted: the note's claim was rewritten for the code there now",
    )
    cite.add_argument(
        "--trust-distribution",
        action="store_true",
        help="learn a new file's blob SHA from the installed distribution named in pins.toml instead "
        "of the git tree (for bootstrapping a lock without access to the remote; recorded)",
    )

    verbs.add_parser(
        "check",
        parents=[common],
        help="verify every citation offline (non-zero exit when broken)",
        description="Verify, without network, that every citation in the lock and in the note "
        "templates resolves to the locked text at the pinned commit, that every note keeps "
        "its rules and renders, that each sha_file matches its pin, and that the "
        "excerpts of each recorded bump hash as the record says.",
    )
    render = verbs.add_parser(
        "render",
        parents=[common],
        help="render the note templates into Markdown for the site",
        description="Render reading_notes/**/*.md.j2 into OUT (NAME.md.j2 -> NAME.md) from the "
        "verified cache, offline, with a page per pinned source and, under "
        "OUT/changes/, a page per citation the latest bump of a source changed "
        "or deleted (old vs new diff) and their index; only changed files are "
        "written, and pages render wrote before but no longer makes are "
        "removed (OUT/.pin-and-cite-pages.json lists them). An OUT holding "
        "Markdown render did not write is refused. Templates render in a "
        "sandbox.",
    )
    render.add_argument("--out", type=Path, default=Path(SITE_NOTES), help="output folder, relative to the project")

    noter = verbs.add_parser(
        "new-note",
        parents=[located],
        help="start a close reading from a skeleton",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Write reading_notes/NAME.md.j2: `rules: close-reading` front matter, the title, five\n"
        "'### ' design choices and '## Connect the dots', with what to write in each as Jinja comments.\n"
        "Then `check` lists what is left to fill, each at its file:line, until the note keeps its rules.\n"
        "Refuses a name already taken; writes the file whole or not at all.",
        epilog="next steps (docs/adding-a-note.md):\n"
        "  tools/pin-and-cite cite SOURCE:PATH::Qual.name   lock the lines a choice cites, then cite() them\n"
        "  tools/pin-and-cite check                         what is still missing, one line each\n"
        "  mkdocs.yml nav                                   give notes/NAME.md its slot in the reading order",
    )
    noter.add_argument("name", metavar="NAME", help="file name without .md.j2: lowercase letters, digits, '-'")
    noter.add_argument("--title", required=True, help="the note's title, its '# ' heading")
    noter.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    noter.set_defaults(timeout=60.0, urls=[])  # it contacts no remote

    bumper = verbs.add_parser(
        "bump",
        parents=[common],
        help="move a pin to a new commit and carry every citation along",
        description="Resolve REF, relocate every citation of source NAME (note templates and lock) to it, "
        "rewrite the line numbers in the templates in place, highlight= ones included (nothing "
        "else changes), update pins.toml and the lock, and print a review report: counts per status, "
        "one line per citation (status, old -> new lines, where it is cited), one per changed default "
        "and per highlight a person should review; with --diff, the old vs new excerpt of each "
        "changed or deleted citation. "
        "The lock also records the bump (replacing the source's previous record), so `render` "
        "can show the same diffs on the site. A REF naming the pinned commit changes nothing (so a "
        "repeated bump keeps the record); two bumps of one project take turns. "
        "All files are written together, or none (any error, or --dry-run).",
    )
    bumper.add_argument("source", metavar="NAME", help="source name in pins.toml")
    bumper.add_argument("--ref", required=True, help="tag, branch or full 40-hex commit SHA to move to")
    bumper.add_argument("--dry-run", action="store_true", help="report what would change; write nothing")
    bumper.add_argument(
        "--distribution",
        metavar="NAME==VERSION",
        help="the wheel of the new pin's release (or none), when REF is no release tag ending in its version",
    )
    bumper.add_argument(
        "--diff", action="store_true", help="end the report with the old vs new excerpt of each changed or deleted"
    )

    relocate = verbs.add_parser(
        "relocate",
        parents=[network],
        help="where do citations made at one commit point at another?",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Follow citations of a git repository from commit OLD to commit NEW: line ranges follow their\n"
        "text, symbols follow their qualified name, into a renamed file or another file when the code\n"
        "left its own. Needs no project; fetches each cited file once per commit (into the cache),\n"
        "however many citations there are, and other files only for code that left its file.",
        epilog="CITE is PATH#Lstart-Lend (1-based, inclusive) or PATH::Qual.name; '-' reads one per line from stdin.\n"
        "--json prints a list in input order, one object per citation:\n"
        '  {"cite": ..., "status": ..., "lines": [start, end] or null, "path": the file the lines are in},\n'
        '  plus "reason" (errors, some changed answers) and "symbol" (a definition now under another name).\n'
        "Statuses: see `pin-and-cite --help`. Exit status 1 when any citation is an error (the others are\n"
        "still answered); 2 for bad arguments or an unknown commit; 3 when the repository cannot be read.",
    )
    relocate.add_argument(
        "--source",
        required=True,
        metavar="GIT_URL_OR_PATH",
        help="the repository: a git URL or a local repository directory",
    )
    relocate.add_argument("--from", dest="old", required=True, metavar="OLD", help="commit, tag or branch cited")
    relocate.add_argument("--to", dest="new", required=True, metavar="NEW", help="commit, tag or branch to follow to")
    relocate.add_argument("cites", nargs="+", metavar="CITE")
    return parser


def cmd_render(project: Project, args) -> int:
    refuse_symlinked((project.root / args.out).absolute(), project.root.absolute())
    changed = render_notes(project.root, project.root / args.out)
    names = [str(p.relative_to(project.root) if p.is_relative_to(project.root) else p) for p in changed]
    print(
        json.dumps({"changed": names}) if args.json else "\n".join(map(printable, names)) or "rendered notes unchanged"
    )
    return 0


def cmd_pin(project: Project, args) -> int:
    existing = project.pins.sources.get(args.source)
    if existing is None and not args.source_url:
        project.pins.get(args.source)  # raises: unknown source
    url = check_url(args.source_url or existing.url)
    if existing is not None and args.source_url and args.source_url != existing.url:
        raise PinAndCiteError(f"source {args.source!r} already has url {existing.url}; edit pins.toml to change it")
    commit = project.remote_at(args.source, url).resolve_ref(args.ref)
    locked = [k for k, f in project.lock.files.items() if k.startswith(f"{args.source}:") and f.commit != commit]
    if locked and not args.force:
        raise PinAndCiteError(
            f"{len(locked)} locked file(s) of {args.source} are at {existing.commit[:12]}; "
            f"moving the pin to {commit[:12]} would orphan their citations: use "
            f"`pin-and-cite bump {args.source} --ref {args.ref}` to carry them along (or --force)"
        )
    project.pins.set_commit(args.source, url, commit, None if is_full_sha(args.ref) else args.ref)
    result = {
        "source": args.source,
        "commit": commit,
        "tag": None if is_full_sha(args.ref) else args.ref,
        "previous": existing.commit if existing else None,
    }
    print(json.dumps(result) if args.json else printable(f"pinned {args.source} at {commit} ({args.ref})"))
    return 0


def cmd_fetch(project: Project, args) -> int:
    def progress(item: Fetched, n: int, total: int) -> None:
        print(
            printable(
                f"[{n}/{total}] {item.source}:{item.path} <- {item.origin}" + (f" ({item.note})" if item.note else "")
            ),
            file=sys.stderr,
        )

    fetched = fetch_all(project, progress)
    if args.json:
        print(json.dumps([vars(f) for f in fetched], indent=2))
    else:
        print(printable(f"{len(fetched)} file(s) verified in {project.store.root}"))
    return 0


def cmd_cite(project: Project, args) -> int:
    if args.default:
        return cmd_cite_default(project, args)
    specs = [parse_spec(text) for text in args.specs]  # refuse any malformed spec before work
    for spec in [] if args.no_lock or args.rewritten else specs:
        if bump := project.lock.deleted_by_bump(str(spec)):
            raise PinAndCiteError(
                f"{spec}: the bump to {bump} deleted the code it cited, so the prose around it describes code "
                "that is gone: rewrite the claim, then `cite --rewritten` it"
            )
        if left := project.lock.left_by_bump(str(spec)):  # its lines hold other code now: never lock them as it
            raise PinAndCiteError(
                f"{spec}: {left} (or, once the claim is rewritten for what these lines hold now, `cite --rewritten` it)"
            )
    resolver = Resolver(project, trust_distribution=args.trust_distribution)
    excerpts = []
    for spec in specs:
        excerpt, learned = resolver.resolve(spec)
        excerpts.append(excerpt)
        if not args.no_lock:
            resolver.record(excerpt, learned)
    if not args.no_lock:
        project.lock.save()
    if args.json:
        print(json.dumps([e.as_json() for e in excerpts], indent=2))
        return 0
    for e in excerpts:
        symbol = f" ({e.spec.symbol})" if e.spec.symbol else ""
        print(printable(f"{e.source.name}:{e.spec.path}#L{e.lines[0]}-L{e.lines[1]}{symbol} @ {e.source.commit[:12]}"))
        if e.permalink:
            print(printable(e.permalink))
        print(_printable_lines(e.numbered()))
    return 0


def cmd_cite_default(project: Project, args) -> int:
    refs = [default_ref(text, param) for text in args.specs for param in args.default]  # all parsed before work
    for ref in [] if args.no_lock or args.rewritten else refs:
        if left := project.lock.left_by_bump(str(ref)):  # as `check` says it
            raise PinAndCiteError(f"{ref}: {left}")
    resolver = Resolver(project, trust_distribution=args.trust_distribution)
    found = []
    for ref in refs:
        default, excerpt, learned = resolver.resolve_default(ref)
        found.append((ref, default, excerpt))
        if not args.no_lock:
            resolver.record_default(ref, default, excerpt, learned)
    if not args.no_lock:
        project.lock.save()
    rows = [
        {
            "default": str(ref),
            "param": ref.param,
            "value": d.value,
            "line": d.line,
            "commit": e.source.commit,
            "permalink": e.source.permalink(ref.spec.path, (d.line, d.line)),
        }
        for ref, d, e in found
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    for row in [] if args.json else rows:
        print(f"{row['default']} @ {row['commit'][:12]}: {row['param']}={row['value']} (L{row['line']})")
    return 0


def cmd_new_note(project: Project, args) -> int:
    path = new_note(project.notes_dir, args.name, args.title, load_plugin(project).skeleton)
    shown = path.relative_to(project.root).as_posix()
    print(
        json.dumps({"written": shown}) if args.json else f"wrote {shown}; `tools/pin-and-cite check` lists what to fill"
    )
    return 0


def cmd_check(project: Project, args) -> int:
    report = check(project)
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        for problem in report.problems:
            print(printable(str(problem)))
        print(f"{report.ok} citation(s) ok, {len(report.problems)} broken")
    return 1 if report.problems else 0


def cmd_bump(project: Project, args) -> int:
    try:
        planned = bump.plan(project, args.source, args.ref, args.distribution)
    except bump.AlreadyPinned as done:
        print(
            json.dumps(
                {
                    "source": done.source,
                    "from": done.commit,
                    "to": done.commit,
                    "dry_run": args.dry_run,
                    "written": [],
                    "citations": [],
                    "note": str(done),
                }
            )
            if args.json
            else done
        )
        return 0
    if not args.dry_run:
        bump.apply(planned, project.notes_dir)
    if args.json:
        print(json.dumps(review.json_report(planned, project.root, args.dry_run), indent=2))
    else:
        print(_printable_lines(review.text_report(planned, project.root, args.dry_run, args.diff)))
    return 0


def _printable_lines(text: str) -> str:
    """A report of several lines, each escaped (upstream text may hold bidi or control characters); tabs kept."""
    return "\n".join("\t".join(map(printable, line.split("\t"))) for line in text.split("\n"))


def _read_cites(args: list[str]) -> list[str]:
    if args == ["-"]:
        return [line.strip() for line in sys.stdin if line.strip()]
    if "-" in args:
        raise PinAndCiteError("'-' (read citations from stdin) must be the only CITE")
    return args


def cmd_relocate(args) -> int:
    texts = _read_cites(args.cites)
    results = relocate_texts(args.source, args.old, args.new, texts, args.timeout)
    if args.json:
        print("[\n" + ",\n".join(json.dumps(r) for r in results) + "\n]")  # one citation per line
    else:
        for r in results:
            where = f"L{r['lines'][0]}-L{r['lines'][1]}" if r["lines"] else "-"
            if r["lines"] and not r["cite"].startswith(r["path"] + "#") and not r["cite"].startswith(r["path"] + "::"):
                where = f"{r['path']}#{where}"  # the code went into another file
            if "symbol" in r:
                where += f" ({r['symbol']})"
            print(
                printable(f"{r['status']:<9} {r['cite']} -> {where}" + (f"  ({r['reason']})" if "reason" in r else ""))
            )
    return 1 if any(r["status"] == "error" for r in results) else 0


COMMANDS = {
    "pin": cmd_pin,
    "fetch": cmd_fetch,
    "cite": cmd_cite,
    "check": cmd_check,
    "render": cmd_render,
    "bump": cmd_bump,
    "new-note": cmd_new_note,
}
WRITERS = {"pin", "cite", "bump", "render", "new-note"}  # verbs that write the project
STANDALONE = {"relocate": cmd_relocate}  # verbs that need no project


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.verb in STANDALONE:
            return STANDALONE[args.verb](args)
        root = args.project or find_root(Path.cwd())
        if args.verb not in WRITERS:  # read-only: never recovers a journal, never takes the write lock
            project = Project(root, timeout=args.timeout, url_overrides=dict(args.urls))
            journal.refuse_pending(project.notes_dir, args.verb)
            return COMMANDS[args.verb](project, args)
        with write_lock(root):  # pins and lock read under it
            if recovered := journal.recover(root / NOTES_DIR):  # a bump killed mid-write
                print(f"pin-and-cite: {recovered}", file=sys.stderr)
            return COMMANDS[args.verb](Project(root, timeout=args.timeout, url_overrides=dict(args.urls)), args)
    except PinAndCiteError as exc:
        print(f"pin-and-cite: error: {printable(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # the machine's, not the input's: disk full, permissions
        print(
            printable(
                f"pin-and-cite: error: {exc.strerror or exc}: {exc.filename or ''} (nothing was left half-written)"
            ),
            file=sys.stderr,
        )
        return LOCAL_IO
    except KeyboardInterrupt:
        print("pin-and-cite: interrupted; nothing was left half-written", file=sys.stderr, flush=True)
        os._exit(130)  # now: gitpython's timeout watchdog thread would otherwise keep the process alive
