"""Render reading_notes/*.md.j2 into Markdown for the site: excerpts come from pinned, verified sources.

Templates see these globals: `cite(spec, highlight=)` (a verified excerpt with upstream line numbers),
`upstream(spec)` (the same citation as a permalink only), `default(spec, param)` (a parameter's default as
written in the pinned source, pin_and_cite.core.defaults), `ours("reference/x.py::Name")` (lines of our own
code, linked to that code, which the page shows at its end under OUR_CODE), `mirrors("reference/x.py::Name")`
(the upstream() links of the citations its docstring writes),
`verified_by("tests/...::test")` (the test and the kind of evidence it is: upstream or reference,
linked to its section on its test file's page, pin_and_cite.site.evidence_pages) and
`reference_only(REASON, detail)` (why no upstream test can run here, REASON from a fixed list), `pins` and
`locked_files(source)`; and the helpers the project's plugin registers (pin_and_cite.site.plugin), so that the
renderer imports none of them. Each note is checked against the plugin's note rules before it is rendered. A
template whose name starts with `_` is a partial: `_source.md.j2` is rendered once per pinned source into
sources/NAME.md. The pages of what the latest bump of each source changed go to changes/
(pin_and_cite.site.changes).

Everything is rendered in memory first, and only then written, and only files whose text changed (mkdocs
watches docs/: rewriting an unchanged page would trigger the next live-reload forever). A failure anywhere
names the template file and line and leaves the previous output as it was. Templates run in a sandbox
(pin_and_cite.core.sandbox); pages are written, and only render's own removed, by pin_and_cite.site.output_folder.
"""

from __future__ import annotations

import html
from pathlib import Path

import jinja2

from pin_and_cite.core import sandbox, symbols
from pin_and_cite.core.citation import parse_spec
from pin_and_cite.core.compiled_templates import CompiledTemplates
from pin_and_cite.core.context import Context
from pin_and_cite.core.defaults import default_ref
from pin_and_cite.core.errors import PinAndCiteError
from pin_and_cite.core.fences import code_span, fence_for
from pin_and_cite.core.highlights import Statements, checked_highlight
from pin_and_cite.core.local_code import Definition, definition, mirrored
from pin_and_cite.core.locked import locked_default, locked_excerpt
from pin_and_cite.core.notes import NotesLoader, note_templates
from pin_and_cite.core.pinned_sha import write_pinned_sha
from pin_and_cite.core.project import Project
from pin_and_cite.core.resolve import Excerpt, Resolver
from pin_and_cite.core.verified_by import Evidence, evidence_of, reference_only_problem
from pin_and_cite.site.changes import change_pages
from pin_and_cite.site.evidence_pages import evidence_pages, link_from
from pin_and_cite.site.folding import fold_window, folded_markdown
from pin_and_cite.site.output_folder import OutputFolder
from pin_and_cite.site.page_cache import PageCache, code_version
from pin_and_cite.site.plugin import SHIPPED_BESIDE, Plugin, load_plugin

SOURCE_PAGE = "_source.md.j2"
OUR_CODE = "The reference code"  # the section ours() links into
MAX_PAGES = 1000  # pages one run renders (a page per note, one per pinned source): the site has under 100
SITE_NOTES = "docs/notes"  # where the site (mkdocs hook) and `render` by default put the pages
TEMPLATE_MISTAKES = (TypeError, ValueError, LookupError, AttributeError, ArithmeticError)
LANGUAGES = {".py": "python", ".pyi": "python", ".h": "cpp", ".cpp": "cpp", ".md": "markdown", ".toml": "toml"}


def evidence_line(kind: str, label: str, what: str) -> str:
    """One evidence line under a claim; its class (evidence-upstream, -reference, -reference-only) styles it."""
    return f'<span class="verified-by evidence-{kind}"><strong>{label}</strong> {what}</span>'


def evidence_link(kind: str, label: str, node_id: str, href: str) -> str:
    """The evidence line of a named test, linked to the page showing its source (Markdown, so that mkdocs
    checks and rewrites the link)."""
    return f"[**{label}** `{node_id}`]({href}){{ .verified-by .evidence-{kind} }}"


def excerpt_link(excerpt: Excerpt, inside: str | None = None) -> str:
    """`path` La–Lb · `symbol` @ `commit` (or · in `symbol` holding a line range), linked to the pinned lines
    when the source has a web URL."""
    first, last = excerpt.lines
    name = f" · `{excerpt.spec.symbol}`" if excerpt.spec.symbol else f" · in `{inside}`" if inside else ""
    label = f"`{excerpt.spec.path}` L{first}–L{last}{name} @ `{excerpt.source.commit[:12]}`"
    return f"[{label}]({excerpt.permalink})" if excerpt.permalink else label


def _refuse_blank_ends(excerpt: Excerpt) -> None:
    """Pygments drops blank first and last lines, so the block would disagree with its caption (and, at the
    start, every line number would shift): such a citation names the lines it should have cited."""
    lines, first = excerpt.text.split("\n")[:-1], excerpt.lines[0]
    if lines[0].strip() and lines[-1].strip():
        return
    text = [n for n, line in enumerate(lines, first) if line.strip()]
    better = f"L{text[0]}-L{text[-1]}" if text else "a range with code in it"
    raise PinAndCiteError(
        f"{excerpt.spec} starts or ends with a blank line, which the page cannot number correctly; cite {better}"
    )


def excerpt_markdown(
    excerpt: Excerpt, highlight: str | None = None, inside: str | None = None, statements: Statements | None = None
) -> str:
    """The excerpt as a fenced block numbered with upstream line numbers, under a permalinked caption; a
    highlight must keep to the `statements` of a Python file (pin_and_cite.core.highlights). A long excerpt
    folds to its highlighted lines (pin_and_cite.site.folding)."""
    _refuse_blank_ends(excerpt)
    first = excerpt.lines[0]
    span = checked_highlight(str(excerpt.spec), highlight, excerpt.lines, statements) if highlight else None
    caption = excerpt_link(excerpt, inside)
    lang = LANGUAGES.get(Path(excerpt.spec.path).suffix, "text")
    fence = fence_for(excerpt.text)

    def block(start: int, text: str) -> str:
        hl = f' hl_lines="{span[0] - start + 1}-{span[1] - start + 1}"' if span else ""
        return f'{fence}{lang} linenums="{start}"{hl}\n{text}{fence}\n'

    lines = excerpt.text.split("\n")[:-1]
    window = fold_window(lines, first, span)
    if window is None:
        return f"{caption}\n\n{block(first, excerpt.text)}"
    top, bottom = window
    shown = "".join(line + "\n" for line in lines[top - first : bottom - first + 1])
    return f"{caption}\n\n{folded_markdown(block(top, shown), block(first, excerpt.text), excerpt.lines)}"


class Renderer:
    def __init__(self, project: Project, resolver: Resolver | None = None, plugin: Plugin | None = None):
        self.project = project
        self.resolver = resolver or Resolver(project, allow_remote=False)
        self.context = Context(project.root, self.resolver.parsed)  # what every reader of the checkout gets
        self.plugin = plugin or load_plugin(project)
        self._rules: dict[Path, list] = {}
        self.page: str | None = None  # the page being rendered, for relative links
        self.cited_tests: dict[str, tuple[Evidence, list[str]]] = {}  # node id -> evidence, citing pages
        self.our_code: dict[str, Definition] = {}  # anchor -> definition ours() linked, on the page being rendered
        self.pages: PageCache | None = PageCache(  # None: render every page afresh
            project.root, project.notes_dir, project.cache_dir, code_version(SHIPPED_BESIDE)
        )
        self._read: dict[str, str | None] = {}  # repository file -> its SHA-256 before this page read it
        self._cited: list[str] = []  # the tests this page names
        loader = CompiledTemplates(NotesLoader(project.notes_dir), project.cache_dir)
        self.env = sandbox.environment(loader)
        self.env.globals.update(
            cite=self.cite,
            upstream=self.upstream,
            default=self.default,
            verified_by=self.verified_by,
            reference_only=self.reference_only,
            pins=project.pins.sources,
            ours=self.ours,
            mirrors=self.mirrors,
            locked_files=self.locked_files,
        )
        self.env.globals.update(self.plugin.helpers(self.context))

    def excerpt(self, spec_text: str) -> Excerpt:
        key = str(parse_spec(spec_text))
        if left := self.project.lock.left_by_bump(key):
            raise PinAndCiteError(f"{key}: {left}")
        if key not in self.project.lock.citations:
            raise PinAndCiteError(f"{key} is not in the lock; run `tools/pin-and-cite cite` on it")
        try:
            return locked_excerpt(self.project, self.resolver, key)
        except PinAndCiteError as exc:
            raise PinAndCiteError(f"{key}: {exc}") from None

    def inside(self, excerpt: Excerpt) -> str | None:
        """For a line range in a Python file, the innermost definition holding it."""
        if excerpt.spec.symbol or not excerpt.spec.path.endswith(".py"):
            return None
        return symbols.enclosing(
            self.resolver.definitions_of(excerpt.source.name, excerpt.spec.path, excerpt.blob), excerpt.lines
        )

    def cite(self, spec_text: str, highlight: str | None = None) -> str:
        excerpt = self.excerpt(spec_text)
        statements = self.resolver.statements_in(excerpt) if highlight else None
        return excerpt_markdown(excerpt, highlight, self.inside(excerpt), statements)

    def upstream(self, spec_text: str) -> str:
        excerpt = self.excerpt(spec_text)
        return excerpt_link(excerpt, self.inside(excerpt))

    def _reads(self, path: str) -> None:
        """The page is about to read the repository file `path`: its entry must name it."""
        if self.pages is not None and path not in self._read:
            self._read[path] = self.pages.sha(path)

    def ours(self, spec: str) -> str:
        """Where our definition lives, linked to its code, which render() appends to the page."""
        self._reads(spec.partition("::")[0])
        found = definition(self.context, spec)
        anchor = "code-" + "".join(ch if ch.isalnum() else "-" for ch in f"{found.path}-{found.symbol}").lower()
        self.our_code[anchor] = found
        return f"[{found}](#{anchor})"

    def _our_code_section(self) -> str:
        """Each definition ours() linked on this page, with our file's line numbers."""
        if not self.our_code:
            return ""
        out = [f"\n## {OUR_CODE}\n"]
        for anchor, found in self.our_code.items():
            fence = fence_for(found.text)
            out.append(
                f'<p class="our-code" id="{anchor}" data-path="{html.escape(found.path)}"><code>'
                f"{html.escape(found.symbol)}</code>, {html.escape(found.path)} L{found.first}–L{found.last}</p>\n\n"
                f'{fence}python linenums="{found.first}"\n{found.text}{fence}\n'
            )
        return "\n".join(out)

    def mirrors(self, ours_spec: str) -> str:
        """The upstream() links of the citations in the docstring of our `reference/x.py::Name`."""
        self._reads(ours_spec.partition("::")[0])
        return ", ".join(self.upstream(spec) for spec in mirrored(self.context, ours_spec))

    def default(self, spec_text: str, param: str) -> str:
        """`param=VALUE` as the pinned source writes it, linked to its line."""
        ref = default_ref(spec_text, param)
        try:
            found, excerpt = locked_default(self.project, self.resolver, ref)
        except PinAndCiteError as exc:
            raise PinAndCiteError(f"{ref}: {exc}") from None
        shown = code_span(f"{param}={found.value}")
        link = excerpt.source.permalink(excerpt.spec.path, (found.line, found.line))
        return f"[{shown}]({link})" if link else shown

    def locked_files(self, source: str) -> list[dict]:
        """The source's files in the lock, with their blob SHA and how many citations read each."""
        prefix, pinned = f"{source}:", self.project.pins.get(source)
        return [
            {
                "path": key.removeprefix(prefix),
                **vars(entry),
                "url": pinned.file_url(key.removeprefix(prefix)),
                "citations": sum(
                    1 for c in self.project.lock.citations if c.startswith(f"{key}#") or c.startswith(f"{key}::")
                ),
            }
            for key, entry in sorted(self.project.lock.files.items())
            if key.startswith(prefix)
        ]

    def verified_by(self, node_id: str) -> str:
        """The test and its kind of evidence (it runs the pinned upstream itself, or the reference only),
        linked to its section on the page of the test file (pin_and_cite.site.evidence_pages)."""
        self._reads(node_id.partition("::")[0])
        if node_id not in self._cited:
            self._cited.append(node_id)
        found = evidence_of(self.context, node_id)
        if isinstance(found, str):
            raise PinAndCiteError(f"verified_by: {found}")
        if found.kind == "upstream" and found.source not in self.project.pins.sources:
            raise PinAndCiteError(
                f"verified_by: {node_id} is marked upstream({found.source!r}), which is not a "
                f"source in pins.toml ({', '.join(sorted(self.project.pins.sources))})"
            )
        citing = self.cited_tests.setdefault(node_id, (found, []))[1]
        if self.page is not None and self.page not in citing:
            citing.append(self.page)
        label = "reference test" if found.kind == "reference" else f"upstream test ({found.source})"
        return evidence_link(found.kind, label, node_id, link_from(self.page, node_id))

    @staticmethod
    def reference_only(reason: str, detail: str = "") -> str:
        """A claim no upstream test can show here, for a reason from the fixed list (APEX, CUDA-only, ...)."""
        problem = reference_only_problem(reason)
        if problem or not isinstance(detail, str):
            raise PinAndCiteError(problem or "reference_only(REASON, DETAIL): DETAIL is a string")
        shown = f"{reason}: {detail.strip()}" if detail.strip() else reason
        return evidence_line("reference-only", "reference only", html.escape(shown))

    def rule_problems(self, template: Path) -> list:
        """The plugin's note rules on `template`, once per template for this renderer (a page per source reuses
        them)."""
        if template not in self._rules:
            try:
                with self.env.bounded():  # the rules spend the run's CPU as its pages do
                    self._rules[template] = self.plugin.note_rules(template, self.context)
            except jinja2.TemplateError as exc:
                raise PinAndCiteError(f"{self._where(template, None)}: the note rules: {exc}") from None
            except sandbox.RunOverBudget as exc:
                raise sandbox.RunOverBudget(f"{self._where(template, None)}: the note rules: {exc}") from None
        return self._rules[template]

    def render(self, template: Path, rules: bool = True, **context) -> str:
        """The page; refused when the note breaks its rules, unless `rules` is False (check reports them)."""
        name = template.relative_to(self.project.notes_dir).as_posix()
        problems = self.rule_problems(template) if rules else []
        if problems:
            raise PinAndCiteError(f"{self._where(template, problems[0].line)}: {problems[0].message}")
        self.our_code, self._read, self._cited = {}, {}, []
        try:
            key = self.pages.key(template, self.page, context) if self.pages else None
            if kept := (self.pages.get(key) if self.pages else None):
                text, cited = kept
                for node_id in cited:  # the test pages list the pages citing each test
                    self.verified_by(node_id)
                return text
            with self.env.bounded():  # Jinja calls filters while it compiles (constant folding): both bounded
                try:
                    compiled = self.env.get_template(name)
                except RecursionError:  # Jinja's parser recurses once per parenthesis, filter or attribute
                    raise PinAndCiteError("the template nests too deep for Jinja to parse") from None
                text = compiled.render(**context) + self._our_code_section()
            if self.pages:
                self.pages.put(key, text, self._cited, self._read)
            return text
        except sandbox.RunOverBudget as exc:  # the run stops here, one line
            raise sandbox.RunOverBudget(f"{self._where(template, _template_line(exc, template))}: {exc}") from None
        except jinja2.TemplateSyntaxError as exc:
            raise PinAndCiteError(f"{self._where(template, exc.lineno)}: {exc.message}") from None
        except (PinAndCiteError, jinja2.TemplateError) as exc:
            raise PinAndCiteError(f"{self._where(template, _template_line(exc, template))}: {exc}") from None
        except RecursionError as exc:
            raise PinAndCiteError(
                f"{self._where(template, _template_line(exc, template))}: templates include or "
                f"extend each other without end"
            ) from None
        except TEMPLATE_MISTAKES as exc:  # e.g. a global called with a missing or misspelled argument
            where = self._where(template, _template_line(exc, template))
            raise PinAndCiteError(f"{where}: {type(exc).__name__}: {exc}") from None

    def _where(self, template: Path, line: int | None) -> str:
        return f"{template.relative_to(self.project.root)}:{line or '?'}"


def _template_line(exc: BaseException, template: Path) -> int | None:
    """The template line a runtime error came from (Jinja rewrites tracebacks to template frames)."""
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == str(template):
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def pages(project: Project) -> list[tuple[Path, dict, str]]:
    """Every page the templates make, as (template, context, output path under the notes folder): a page per
    note template (partials, `_*.md.j2`, excepted) and one per pinned source from SOURCE_PAGE."""
    found = [
        (t, {}, t.relative_to(project.notes_dir).with_suffix("").as_posix()) for t in note_templates(project.notes_dir)
    ]
    source_page = project.notes_dir / SOURCE_PAGE
    if source_page.is_file():
        found += [
            (source_page, {"source": source}, f"sources/{name}.md") for name, source in project.pins.sources.items()
        ]
    if len(found) > MAX_PAGES:
        raise PinAndCiteError(f"{project.notes_dir} makes {len(found)} pages, over the bound of {MAX_PAGES}")
    return found


def render_notes(root: Path, out_dir: Path) -> list[Path]:
    """Render every note template into `out_dir` (NAME.md.j2 -> NAME.md), the source pages, the page of each
    test file whose tests a note cites (tests/) and the change pages, with the plugin's helpers; return the
    files that changed (stale pages render wrote, say of a replaced bump record, are removed, with their
    emptied folders: pin_and_cite.site.output_folder). A page that does not render (a note a bump broke) is
    refused and left as it was, as are the test pages (which list the notes citing each test) and nothing is
    removed, but every other page is written, so the change pages that say what to fix are there to read; then
    the first refusal is raised."""
    project = Project(root)
    renderer = Renderer(project)
    rendered, broken = {}, []
    for template, context, page in pages(project):
        renderer.page = page
        try:
            rendered[out_dir / page] = renderer.render(template, **context)
        except sandbox.RunOverBudget:
            raise
        except PinAndCiteError as exc:  # its page stays as it was; the others, change pages first, still render
            broken.append(str(exc))
    if not broken:  # a refused note's tests are unknown: the test pages stay as they were
        test_pages = evidence_pages(root, renderer.cited_tests, project.cache_dir)
        rendered.update({out_dir / page: text for page, text in test_pages.items()})
    rendered.update(change_pages(project, renderer.resolver, out_dir))
    site_folder = out_dir.resolve() == (project.root / SITE_NOTES).resolve()
    written = OutputFolder(out_dir, adopt_legacy_pages=site_folder).write(
        {path.relative_to(out_dir).as_posix(): text for path, text in rendered.items()}, remove_stale=not broken
    )
    written = write_pinned_sha(project) + written
    if broken:
        more = f" (and {len(broken) - 1} more page(s))" if len(broken) > 1 else ""
        raise PinAndCiteError(f"{broken[0]}{more}; that page was left as it was, the others rendered")
    return written
