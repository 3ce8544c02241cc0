"""Resolve `Class.method` to the line span of its definition with the stdlib AST, decorators included."""
from __future__ import annotations

import ast

from pin_and_cite.core.errors import PinAndCiteError

PYTHON_SUFFIXES = (".py", ".pyi")
_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
_BLOCKS = (ast.If, ast.Try, ast.With, ast.AsyncWith, ast.For, ast.AsyncFor, ast.While)


def parse(source: str, filename: str) -> ast.Module:
    try:
        return ast.parse(source, filename=filename)
    except SyntaxError as exc:
        raise PinAndCiteError(f"{filename} is not valid Python (line {exc.lineno}); cite it by line range") from None
    except (MemoryError, RecursionError):                       # CPython's parser on absurdly deep nesting
        raise PinAndCiteError(f"{filename} nests too deeply for Python's parser; cite it by line range") from None


def definitions(source: str, filename: str) -> dict[str, list[tuple[int, int]]]:
    return definitions_in(parse(source, filename))


def definitions_in(tree: ast.Module) -> dict[str, list[tuple[int, int]]]:
    """Every class/function qualified name -> spans [(first decorator or def line, last line)].

    Definitions under `if`/`try`/`with` blocks keep their enclosing qualified name, as at runtime; a
    name defined twice (say, in both arms of an `if`) gets two spans, which makes citing it ambiguous.
    """
    found: dict[str, list[tuple[int, int]]] = {}

    def visit(statements, prefix: str) -> None:
        for node in statements:
            if isinstance(node, _DEFS):
                name = prefix + node.name
                first = min([d.lineno for d in node.decorator_list] + [node.lineno])
                found.setdefault(name, []).append((first, node.end_lineno))
                visit(node.body, name + ".")
            elif isinstance(node, _BLOCKS):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    visit(getattr(node, field, []), prefix)
            elif isinstance(node, ast.ExceptHandler):
                visit(node.body, prefix)

    visit(tree.body, "")
    return found


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
    holding = [(b - a, name) for name, spans in definitions_by_name.items() for a, b in spans
               if a <= lines[0] and lines[1] <= b]
    return min(holding)[1] if holding else None
