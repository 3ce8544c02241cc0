"""Render reading_notes/*.md.j2 into Markdown for the site: excerpts come from pinned, verified sources.

Templates see these globals: `cite(spec, highlight=)` (a verified excerpt with upstream line numbers),
`upstream(spec)` (the same citation as a permalink only), `ours("reference/x.py::Name")` (lines of our own
code), `verified_by("tests/...::test")`, `trace(name)` with `diagram(name, ...)`, `tp_crossover(...)` and
`fsdp_overlap(...)`, `pipeline_memory(...)` (recorded runs, pin_and_cite.traces), `pins` and
`locked_files(source)`.
Close-reading notes are checked against pin_and_cite.note_rules before they are rendered. A template whose
name starts with `_` is a partial: `_source.md.j2` is rendered once per pinned source into sources/NAME.md.
The pages of what the latest bump of each source changed go to changes/ (pin_and_cite.changes).

Everything is rendered in memory first, and only then written, and only files whose text changed (mkdocs
watches docs/: rewriting an unchanged page would trigger the next live-reload forever). A failure anywhere
names the template file and line and leaves the previous output as it was.
"""
from __future__ import annotations

from pathlib import Path

import jinja2

from pin_and_cite.atomic import atomic_write
from pin_and_cite import diagrams, estimates, scale_tables, symbols
from reference.scale.formulas import human  # the scale tables' byte format, for the Scale page
from pin_and_cite.changes import change_pages
from pin_and_cite.check import locked_excerpt
from pin_and_cite.citation import parse_spec
from pin_and_cite.errors import PinAndCiteError
from pin_and_cite.fences import fence_for
from pin_and_cite.local_code import ours
from pin_and_cite.note_rules import check_note
from pin_and_cite.notes import note_templates
from pin_and_cite.pinned_sha import write_pinned_sha
from pin_and_cite.project import Project
from pin_and_cite.resolve import Excerpt, Resolver
from pin_and_cite.traces import load_trace
from pin_and_cite.verified_by import missing_test

SOURCE_PAGE = "_source.md.j2"
TEMPLATE_MISTAKES = (TypeError, ValueError, LookupError, AttributeError, ArithmeticError)
LANGUAGES = {".py": "python", ".pyi": "python", ".h": "cpp", ".cpp": "cpp", ".md": "markdown", ".toml": "toml"}


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
    raise PinAndCiteError(f"{excerpt.spec} starts or ends with a blank line, which the page cannot number "
                          f"correctly; cite {better}")


def excerpt_markdown(excerpt: Excerpt, highlight: str | None = None, inside: str | None = None) -> str:
    """The excerpt as a fenced block numbered with upstream line numbers, under a permalinked caption."""
    _refuse_blank_ends(excerpt)
    first, last = excerpt.lines
    hl = ""
    if highlight:
        spec = parse_spec(f"{excerpt.source.name}:{excerpt.spec.path}#{highlight}")
        a, b = spec.lines
        if not (first <= a and b <= last):
            raise PinAndCiteError(f"highlight {highlight} lies outside the cited L{first}-L{last}")
        hl = f' hl_lines="{a - first + 1}-{b - first + 1}"'
    caption = excerpt_link(excerpt, inside)
    lang = LANGUAGES.get(Path(excerpt.spec.path).suffix, "text")
    fence = fence_for(excerpt.text)
    return f'{caption}\n\n{fence}{lang} linenums="{first}"{hl}\n{excerpt.text}{fence}\n'


class Renderer:
    def __init__(self, project: Project, resolver: Resolver | None = None):
        self.project = project
        self.resolver = resolver or Resolver(project, allow_remote=False)
        self._rules: dict[Path, list] = {}
        self.env = jinja2.Environment(loader=jinja2.FileSystemLoader(project.notes_dir), undefined=jinja2.StrictUndefined,
                                      keep_trailing_newline=True, autoescape=False)
        self.env.globals.update(
            cite=self.cite, upstream=self.upstream, verified_by=self.verified_by, pins=project.pins.sources,
            ours=lambda spec: ours(project.root, spec), locked_files=self.locked_files,
            trace=lambda name: load_trace(project.notes_dir, name), diagram=self.diagram,
            tp_crossover=estimates.tp_crossover, fsdp_overlap=estimates.fsdp_overlap,
            pipeline_memory=estimates.pipeline_memory,
            scale_table=scale_tables.scale_table, sent_per_group=scale_tables.sent_per_group,
            human=human)

    def excerpt(self, spec_text: str) -> Excerpt:
        key = str(parse_spec(spec_text))
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
        return symbols.enclosing(self.resolver.definitions_of(excerpt.source.name, excerpt.spec.path, excerpt.blob),
                                 excerpt.lines)

    def cite(self, spec_text: str, highlight: str | None = None) -> str:
        excerpt = self.excerpt(spec_text)
        return excerpt_markdown(excerpt, highlight, self.inside(excerpt))

    def upstream(self, spec_text: str) -> str:
        excerpt = self.excerpt(spec_text)
        return excerpt_link(excerpt, self.inside(excerpt))

    def diagram(self, name: str, **options) -> str:
        return diagrams.diagram(load_trace(self.project.notes_dir, name), **options)

    def locked_files(self, source: str) -> list[dict]:
        """The source's files in the lock, with their blob SHA and how many citations read each."""
        prefix, pinned = f"{source}:", self.project.pins.get(source)
        return [{"path": key.removeprefix(prefix), **vars(entry), "url": pinned.file_url(key.removeprefix(prefix)),
                 "citations": sum(1 for c in self.project.lock.citations if c.startswith(f"{key}#")
                                  or c.startswith(f"{key}::"))}
                for key, entry in sorted(self.project.lock.files.items()) if key.startswith(prefix)]

    def verified_by(self, node_id: str) -> str:
        why = missing_test(self.project.root, node_id)
        if why:
            raise PinAndCiteError(f"verified_by: {why}")
        return f'<span class="verified-by">verified by <code>{node_id}</code></span>'

    def rule_problems(self, template: Path) -> list:
        """check_note(template), once per template for this renderer (a page per source reuses it)."""
        if template not in self._rules:
            self._rules[template] = check_note(template)
        return self._rules[template]

    def render(self, template: Path, **context) -> str:
        name = template.relative_to(self.project.notes_dir).as_posix()
        problems = self.rule_problems(template)
        if problems:
            raise PinAndCiteError(f"{self._where(template, problems[0].line)}: {problems[0].message}")
        try:
            return self.env.get_template(name).render(**context)
        except jinja2.TemplateSyntaxError as exc:
            raise PinAndCiteError(f"{self._where(template, exc.lineno)}: {exc.message}") from None
        except (PinAndCiteError, jinja2.TemplateError) as exc:
            raise PinAndCiteError(f"{self._where(template, _template_line(exc, template))}: {exc}") from None
        except RecursionError as exc:
            raise PinAndCiteError(f"{self._where(template, _template_line(exc, template))}: templates include or "
                                  f"extend each other without end") from None
        except TEMPLATE_MISTAKES as exc:      # e.g. a global called with a missing or misspelled argument
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
    found = [(t, {}, t.relative_to(project.notes_dir).with_suffix("").as_posix())
             for t in note_templates(project.notes_dir)]
    source_page = project.notes_dir / SOURCE_PAGE
    if source_page.is_file():
        found += [(source_page, {"source": source}, f"sources/{name}.md")
                  for name, source in project.pins.sources.items()]
    return found


def render_notes(root: Path, out_dir: Path) -> list[Path]:
    """Render every note template into `out_dir` (NAME.md.j2 -> NAME.md), the source pages and the change pages;
    return the files that changed (stale pages, say of a replaced bump record, are removed)."""
    project = Project(root)
    renderer = Renderer(project)
    rendered = {out_dir / page: renderer.render(template, **context) for template, context, page in pages(project)}
    rendered.update(change_pages(project, renderer.resolver, out_dir))
    changed = write_pinned_sha(project)
    for path, text in rendered.items():
        if not path.exists() or path.read_text() != text:
            atomic_write(path, text.encode())
            changed.append(path)
    for stale in set(out_dir.rglob("*.md")) - set(rendered):      # a template was removed or renamed
        stale.unlink()
        changed.append(stale)
    return changed
