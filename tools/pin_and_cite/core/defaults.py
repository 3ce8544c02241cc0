"""`default("SOURCE:PATH::Qual.name", "param")`: a parameter's default as written in the pinned source.

A note that says "`forward_prefetch` defaults to False" states a fact about upstream that can change between
pins like any cited line. So the default is read, never typed: from the pinned, hash-verified file, with the
stdlib AST (the file is never imported), either from a function's signature (`Qual.name` a function or
method: its positional or keyword-only parameter) or from a class body (`Qual.name` a dataclass or config
class: the annotated field, or `field(default=...)`). It is locked like a citation, under the key
`SOURCE:PATH::Qual.name(param)`, with the default's source text and line, so `check` proves it offline and
`bump` reports when it changed.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from pin_and_cite.core import symbols
from pin_and_cite.core.citation import Spec, parse_spec
from pin_and_cite.core.errors import PinAndCiteError

_PARAM = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY = re.compile(r"(?P<spec>.+)\((?P<param>[A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class DefaultRef:
    """A default a note asks for: the symbol that declares the parameter, and the parameter's name."""

    spec: Spec
    param: str

    def __str__(self) -> str:
        return f"{self.spec}({self.param})"


@dataclass(frozen=True)
class FoundDefault:
    """The default as written upstream: its source text (`False`, `BackwardPrefetch.BACKWARD_PRE`) and line."""

    value: str
    line: int


def default_ref(spec_text: str, param: str) -> DefaultRef:
    """Parse what a template or the CLI names; only a symbol citation can declare a parameter."""
    spec = parse_spec(spec_text)
    if not spec.symbol:
        raise PinAndCiteError(
            f"default({spec_text!r}, ...) needs SOURCE:PATH::Qual.name, the function or class "
            "that declares the parameter"
        )
    if not isinstance(param, str) or not _PARAM.fullmatch(param):
        raise PinAndCiteError(f"default({spec_text!r}, {param!r}): the parameter must be a Python name")
    return DefaultRef(spec, param)


def parse_key(key: str) -> DefaultRef:
    """The lock's key `SOURCE:PATH::Qual.name(param)` back into a DefaultRef."""
    match = _KEY.fullmatch(key)
    if not match:
        raise PinAndCiteError(f"lock default {key!r} is not SOURCE:PATH::Qual.name(param)")
    return default_ref(match["spec"], match["param"])


def _definition(tree: ast.Module, span: tuple[int, int], name: str) -> ast.AST:
    """The class or function node whose span (first decorator to last line) symbols.resolve found."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            if (first, node.end_lineno) == span:
                return node
    raise PinAndCiteError(f"no definition of {name} at L{span[0]}-L{span[1]}")  # symbols and ast disagree: a bug


def _signature_default(node: ast.FunctionDef | ast.AsyncFunctionDef, param: str) -> ast.expr | None | bool:
    """The default expression of `param` (None: the parameter has no default; False: no such parameter)."""
    args = node.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
    return next((default for arg, default in pairs if arg.arg == param), False)


def _field_default(node: ast.ClassDef, param: str) -> ast.expr | None | bool:
    """The default of a class-level field `param: T = value` (`field(default=value)` unwrapped)."""
    for statement in node.body:
        target = statement.target if isinstance(statement, ast.AnnAssign) else None
        if target is None and isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target = statement.targets[0]
        if isinstance(target, ast.Name) and target.id == param:
            value = statement.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) == "field":
                value = next((kw.value for kw in value.keywords if kw.arg == "default"), None)
            return value
    return False


def _segment(lines: tuple[str, ...], node: ast.expr) -> str:
    """The source text of `node` (ast.get_source_segment, without splitting the whole file again per call)."""
    first, last = node.lineno - 1, node.end_lineno - 1
    if first == last:
        return lines[first].encode()[node.col_offset : node.end_col_offset].decode()
    return "\n".join(
        [
            lines[first].encode()[node.col_offset :].decode(),
            *lines[first + 1 : last],
            lines[last].encode()[: node.end_col_offset].decode(),
        ]
    )


def read_default(
    lines: tuple[str, ...], tree: ast.Module, where: str, definitions: dict, ref: DefaultRef
) -> FoundDefault:
    """The default of `ref.param` in the pinned file (its lines and their AST, parsed once per blob by the
    resolver); PinAndCiteError says why there is none."""
    span = symbols.resolve(definitions, ref.spec.symbol, where)
    node = _definition(tree, span, ref.spec.symbol.rsplit(".", 1)[-1])
    found = _field_default(node, ref.param) if isinstance(node, ast.ClassDef) else _signature_default(node, ref.param)
    kind = "field" if isinstance(node, ast.ClassDef) else "parameter"
    if found is False:
        raise PinAndCiteError(f"{ref.spec.symbol} in {where} has no {kind} {ref.param!r}")
    if found is None:
        raise PinAndCiteError(f"{kind} {ref.param!r} of {ref.spec.symbol} in {where} has no default")
    return FoundDefault(_segment(lines, found), found.lineno)
