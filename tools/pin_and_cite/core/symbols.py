"""Resolve `Class.method` to the line span of its definition with the stdlib AST, decorators included."""

from __future__ import annotations

import ast

from pin_and_cite.core.errors import PinAndCiteError

PYTHON_SUFFIXES = (".py", ".pyi")
_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
# Python's AST takes about 150 bytes of memory per byte of source (a 19 MB file once took 4.5 GB): 2 MiB is
# 300 MB, and 13 times the largest file cited (157 KB).
MAX_PARSED_CHARS = 2 << 20
_BLOCKS = (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)


def parse(source: str, filename: str) -> ast.Module:
    """The module's AST; a file over MAX_PARSED_CHARS is refused before it is parsed, in one line."""
    if len(source) > MAX_PARSED_CHARS:
        raise PinAndCiteError(
            f"{filename} is over {MAX_PARSED_CHARS >> 20} MiB, more than a Python file is parsed for its "
            f"definitions; cite it by line range"
        )
    try:
        return ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise PinAndCiteError(f"{filename} is not valid Python (line {exc.lineno}); cite it by line range") from None
    except (MemoryError, RecursionError):  # CPython's parser on absurdly deep nesting
        raise PinAndCiteError(f"{filename} nests too deeply for Python's parser; cite it by line range") from None


def definitions(source: str, filename: str) -> dict[str, list[tuple[int, int]]]:
    return definitions_in(parse(source, filename))


def definitions_in(tree: ast.Module) -> dict[str, list[tuple[int, int]]]:
    """Every class/function qualified name -> spans [(first decorator or def line, last line)].

    Definitions under `if`/`try`/`with` blocks keep their enclosing qualified name, as at runtime; a
    name defined twice (say, in both arms of an `if`) gets two spans, which makes citing it ambiguous.
    """
    found: dict[str, list[tuple[int, int]]] = {}
    for name, node in _named_definitions(tree.body, ""):
        first = min([d.lineno for d in node.decorator_list] + [node.lineno])
        found.setdefault(name, []).append((first, node.end_lineno))
    return found


def docstrings_in(tree: ast.Module) -> dict[str, tuple[int, int]]:
    """Qualified name -> the lines of its docstring, for each class/function that has one (and is defined
    once)."""
    found: dict[str, list[tuple[int, int]]] = {}
    for name, node in _named_definitions(tree.body, ""):
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            found.setdefault(name, []).append((first.lineno, first.end_lineno))
    return {name: spans[0] for name, spans in found.items() if len(spans) == 1}


def _named_definitions(statements, prefix: str):
    """(qualified name, node) of every class and function, depth first, as definitions_in names them."""
    for node in statements:
        if isinstance(node, _DEFS):
            yield prefix + node.name, node
            yield from _named_definitions(node.body, prefix + node.name + ".")
        elif isinstance(node, _BLOCKS):
            for field in ("body", "orelse", "finalbody", "handlers"):
                yield from _named_definitions(getattr(node, field, []), prefix)
        elif isinstance(node, ast.ExceptHandler):
            yield from _named_definitions(node.body, prefix)


def resolve(definitions_by_name: dict[str, list[tuple[int, int]]], symbol: str, where: str) -> tuple[int, int]:
    spans = definitions_by_name.get(symbol)
    if not spans:
        raise PinAndCiteError(f"symbol {symbol!r} is not defined in {where}")
    if len(spans) > 1:
        lines = ", ".join(f"L{a}-L{b}" for a, b in spans)
        raise PinAndCiteError(f"symbol {symbol!r} is ambiguous in {where} (defined at {lines}); cite a line range")
    return spans[0]


def enclosing(definitions_by_name: dict[str, list[tuple[int, int]]], lines: tuple[int, int]) -> str | None:
    """The innermost class or function whose span holds `lines`, for naming a line-range excerpt."""
    holding = [
        (b - a, name)
        for name, spans in definitions_by_name.items()
        for a, b in spans
        if a <= lines[0] and lines[1] <= b
    ]
    return min(holding)[1] if holding else None
