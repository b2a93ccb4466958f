"""Anchoring a mutant to code by its structure, not its text.

A mutant names a function by its dotted name (``hyperdsd.state.model.plan_load``,
``hyperdsd.checkpoint.LoadPlanner.__init__``) and gives a *pattern*, a snippet of
Python, and a *replacement*. :class:`Package` finds the function in any module
of the package: one whose qualified name (``plan_load``, ``LoadPlanner.__init__``)
ends the dotted name, preferring the one whose module path matches more of it,
so that a function moved to another module is still found. Where several
match equally, the one in which the pattern occurs wins; otherwise the name is
ambiguous.

Inside the function the pattern is matched by its syntax tree, not its text:
layout, line breaks, comments and parentheses do not count. A snippet that is
one expression (``fqns``, ``x // n``) matches expressions anywhere in the
function, unless the replacement is a statement; otherwise it matches a
statement, or a run of consecutive statements. ``...`` stands for anything:
one expression, or, in a list (a block of statements, a call's arguments),
any number of them, so ``if extra: ...`` matches the ``if`` whatever its body.
An ``if``, ``for``, ``while`` or ``try`` of the pattern with no ``else``
matches one with an ``else`` too.

The edit is where pattern and replacement differ: only the source text of
those parts of the matched code is replaced (re-indented to where it lands),
so the rest of the module, comments and layout included, is left as it is.
``if extra: ...`` → ``if False: ...`` replaces the test, ``extra``, alone; a
statement of the pattern that the replacement leaves out is deleted, one
that it adds is inserted. The pattern must match exactly once.
"""

from __future__ import annotations

import ast
import os
import textwrap
from dataclasses import dataclass

__all__ = ["AnchorError", "Function", "Package", "apply", "matches"]


class AnchorError(ValueError):
    """The function is gone or ambiguous, or the pattern does not match exactly once."""


# -- finding the function -------------------------------------------------------------------------


@dataclass(frozen=True)
class Function:
    path: str  # the module, relative to the package's directory: "state/model.py"
    qualname: str  # in its module: "LoadPlanner.__init__"; a nested function "deliver.receive"
    name: str  # dotted, the package and module included: "hyperdsd.checkpoint.LoadPlanner.__init__"
    node: ast.FunctionDef | ast.AsyncFunctionDef
    source: str  # the module's source

    @property
    def where(self) -> str:
        return f"{self.path}:{self.node.lineno}"


def _functions(tree: ast.AST):
    """(qualname, node) of every function in a module, methods and nested functions included."""

    def walk(node, stack):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield ".".join([*stack, child.name]), child
                yield from walk(child, [*stack, child.name])
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, [*stack, child.name])
            else:
                yield from walk(child, stack)

    yield from walk(tree, [])


class Package:
    """The functions of every module under ``directory`` (a package: ``.../hyperdsd``)."""

    def __init__(self, directory: str, name: str | None = None):
        self.directory = directory
        self.name = name or os.path.basename(os.path.normpath(directory))
        self.functions: list[Function] = []
        for base, dirs, files in os.walk(directory):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            for file in sorted(files):
                if not file.endswith(".py"):
                    continue
                path = os.path.relpath(os.path.join(base, file), directory).replace(os.sep, "/")
                with open(os.path.join(directory, path)) as f:
                    source = f.read()
                module = [self.name, *path[: -len(".py")].split("/")]
                if module[-1] == "__init__":
                    module.pop()
                for qualname, node in _functions(ast.parse(source, filename=path)):
                    self.functions.append(Function(path, qualname, ".".join([*module, qualname]), node, source))

    def find(self, name: str, pattern: str | None = None, replacement: str = "None") -> Function:
        """The function ``name`` names, wherever it now is (see the module's doc)."""
        parts = name.split(".")
        scored = []
        for f in self.functions:
            q = f.qualname.split(".")
            if len(q) <= len(parts) and parts[-len(q) :] == q:
                full = f.name.split(".")
                n = 0
                while n < min(len(full), len(parts)) and full[-1 - n] == parts[-1 - n]:
                    n += 1
                scored.append((n, f))
        if not scored:
            raise AnchorError(f"function {name} is gone: no module of {self.name}/ defines {parts[-1]}")
        best = max(n for n, _ in scored)
        top = [f for n, f in scored if n == best]
        if len(top) > 1 and pattern is not None:
            holding = [f for f in top if matches(f, pattern, replacement)]
            top = holding if len(holding) == 1 else top
        if len(top) > 1:
            raise AnchorError(f"function {name} is ambiguous: {', '.join(f'{f.name} ({f.where})' for f in top)}")
        return top[0]


# -- matching -------------------------------------------------------------------------------------


def _wild(node) -> bool:
    """``...``: an expression, or a statement of its own."""
    if isinstance(node, ast.Expr):
        node = node.value
    return isinstance(node, ast.Constant) and node.value is Ellipsis


def _loose(field: str, pattern_value) -> bool:
    """An ``else`` the pattern does not have matches any."""
    return field == "orelse" and pattern_value == []


def _match(p, t) -> bool:
    if isinstance(p, ast.AST) and _wild(p) and not isinstance(p, ast.Expr):
        return isinstance(t, ast.AST)
    if type(p) is not type(t):
        return False
    if not isinstance(p, ast.AST):
        return p == t
    for field in p._fields:
        if field == "type_comment":
            continue
        pv, tv = getattr(p, field, None), getattr(t, field, None)
        if isinstance(pv, list):
            if not (_loose(field, pv) or (isinstance(tv, list) and _align(pv, tv) is not None)):
                return False
        elif not _match(pv, tv):
            return False
    return True


def _align(ps: list, ts: list, at: int = 0) -> list[tuple[int, int]] | None:
    """For each pattern element, the slice of ``ts`` it matches (a ``...`` any run), or None."""
    if not ps:
        return [] if at == len(ts) else None
    if _wild(ps[0]):
        for end in range(at, len(ts) + 1):
            rest = _align(ps[1:], ts, end)
            if rest is not None:
                return [(at, end), *rest]
        return None
    if at < len(ts) and _match(ps[0], ts[at]):
        rest = _align(ps[1:], ts, at + 1)
        if rest is not None:
            return [(at, at + 1), *rest]
    return None


@dataclass
class _Snippet:
    source: str
    body: list[ast.stmt]

    @property
    def expression(self) -> ast.expr | None:
        if len(self.body) == 1 and isinstance(self.body[0], ast.Expr):
            return self.body[0].value
        return None


def _snippet(text: str, what: str) -> _Snippet:
    source = textwrap.dedent(text).strip("\n") + "\n"
    try:
        return _Snippet(source, ast.parse(source).body)
    except SyntaxError as exc:
        raise AnchorError(f"the {what} is not Python ({exc.msg}): {text!r}") from None


@dataclass
class _Match:
    node: ast.AST | None  # an expression
    block: list[ast.stmt] | None = None  # or a run of statements: the list it is in
    start: int = 0
    end: int = 0

    @property
    def line(self) -> int:
        return (self.node or self.block[self.start]).lineno


def _blocks(fn: ast.AST):
    for node in ast.walk(fn):
        for field in ("body", "orelse", "finalbody", "handlers"):
            value = getattr(node, field, None)
            if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                yield value


def _find(fn: Function, pattern: _Snippet, replacement: _Snippet) -> list[_Match]:
    if pattern.expression is not None and replacement.expression is not None:
        want = pattern.expression
        return [_Match(node) for node in ast.walk(fn.node) if isinstance(node, ast.expr) and _match(want, node)]
    ps = pattern.body
    if _wild(ps[0]) or _wild(ps[-1]):
        raise AnchorError("a pattern of statements cannot begin or end with ...")
    open_ended = any(map(_wild, ps))
    found = []
    for block in _blocks(fn.node):
        for i in range(len(block)):
            if not _match(ps[0], block[i]):
                continue
            for j in range(i + 1, len(block) + 1) if open_ended else [i + len(ps)]:
                if j <= len(block) and _align(ps, block[i:j]) is not None:
                    found.append(_Match(None, block, i, j))
    return found


def matches(fn: Function, pattern: str, replacement: str = "None") -> list[int]:
    """The lines where ``pattern`` matches in ``fn`` (as an expression if it is one)."""
    return [m.line for m in _find(fn, _snippet(pattern, "pattern"), _snippet(replacement, "replacement"))]


# -- editing --------------------------------------------------------------------------------------


class _Whole(Exception):
    """This part has no position of its own: its parent is replaced whole."""


class _Text:
    """A module's source, indexed by the syntax tree's (line, byte column) positions."""

    def __init__(self, source: str):
        self.source = source
        # lines as the parser counts them: split at newlines only (str.splitlines splits at form feeds too)
        self.lines = [line + "\n" for line in source.split("\n")]
        self.lines[-1] = self.lines[-1][:-1]
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def index(self, line: int, col: int) -> int:
        return self.starts[line - 1] + len(self.lines[line - 1].encode()[:col].decode())

    def span(self, node) -> tuple[int, int]:
        return self.index(node.lineno, node.col_offset), self.index(node.end_lineno, node.end_col_offset)

    def column(self, node) -> int:
        return self.index(node.lineno, node.col_offset) - self.starts[node.lineno - 1]


def _same(a, b) -> bool:
    if isinstance(a, list) or isinstance(b, list):
        return isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, ast.AST) and isinstance(b, ast.AST):
        return ast.dump(a) == ast.dump(b)
    return type(a) is type(b) and a == b


def _precedence(node) -> int:
    """How loosely ``node`` binds (lower: looser); an atom binds tightest."""
    if isinstance(node, (ast.NamedExpr, ast.Tuple, ast.Yield, ast.YieldFrom)):
        return 0
    if isinstance(node, ast.Lambda):
        return 1
    if isinstance(node, ast.IfExp):
        return 2
    if isinstance(node, ast.BoolOp):
        return 3 if isinstance(node.op, ast.Or) else 4
    if isinstance(node, ast.UnaryOp):
        return 5 if isinstance(node.op, ast.Not) else 13
    if isinstance(node, ast.Compare):
        return 6
    if isinstance(node, ast.BinOp):
        order = [(ast.BitOr,), (ast.BitXor,), (ast.BitAnd,), (ast.LShift, ast.RShift), (ast.Add, ast.Sub)]
        for i, ops in enumerate(order):
            if isinstance(node.op, ops):
                return 7 + i
        return 14 if isinstance(node.op, ast.Pow) else 12
    if isinstance(node, ast.Await):
        return 15
    return 99


def _needs_parens(r, t, parent) -> bool:
    """Whether ``r``'s text, put where ``t`` is in ``parent``, must be parenthesised to parse as ``r``."""
    mine = _precedence(r)
    if mine == 99 or not isinstance(parent, (ast.expr, ast.comprehension, ast.keyword)):
        return False
    if isinstance(r, ast.Tuple):
        return True
    if isinstance(parent, (ast.BoolOp, ast.BinOp, ast.UnaryOp, ast.Compare, ast.IfExp, ast.Await)):
        return mine <= _precedence(parent)
    if isinstance(parent, (ast.Attribute, ast.Subscript)) and t is parent.value:
        return True
    if isinstance(parent, ast.Call) and t is parent.func or isinstance(parent, ast.Starred):
        return True
    if isinstance(parent, ast.comprehension) or isinstance(parent, (ast.Dict, ast.DictComp)) and t in _keys(parent):
        return mine <= 2
    return False


def _keys(node) -> list:
    return [node.key] if isinstance(node, ast.DictComp) else node.keys


class _Editor:
    def __init__(self, target: _Text, replacement: _Snippet):
        self.t = target
        self.r = _Text(replacement.source)
        self.edits: list[tuple[int, int, str]] = []

    def text(self, first, last, column: int, comment: bool = False) -> str:
        """The replacement's source from ``first`` to ``last``, re-indented to start at ``column``
        (with ``comment``, the comment that ends the last line too)."""
        start, end = self.r.span(first)[0], self.r.span(last)[1]
        if comment:
            rest = self.r.source[end : self.r.starts[last.end_lineno]].rstrip()
            if rest.strip().startswith("#"):
                end += len(rest)
        lines = self.r.source[start:end].split("\n")
        shift = column - self.r.column(first)
        for i in range(1, len(lines)):
            line = lines[i]
            if shift >= 0:
                lines[i] = " " * shift + line if line.strip() else line
            else:
                lines[i] = line[min(-shift, len(line) - len(line.lstrip(" "))) :]
        return "\n".join(lines)

    def whole(self, p, r, t, parent) -> None:
        """Replace ``t`` (what ``p`` matched) by ``r``."""
        if not hasattr(t, "lineno") or not hasattr(r, "lineno"):
            raise _Whole
        if not _same(p, t):
            raise AnchorError(
                f"the edit at line {t.lineno} would rewrite code the pattern leaves open (a ... or an else): "
                "make the replacement keep it as the pattern has it"
            )
        text = self.text(r, r, self.t.column(t))
        if _needs_parens(r, t, parent):
            text = f"({text})"
        self.edits.append((*self.t.span(t), text))

    def node(self, p, r, t, parent=None) -> None:
        if _same(p, r):
            return
        if _wild(p) or _wild(r):
            raise AnchorError("a ... of the replacement must stand where the pattern's does")
        if type(p) is type(r) and isinstance(p, ast.AST):
            try:
                for field in p._fields:
                    pv, rv, tv = (getattr(x, field, None) for x in (p, r, t))
                    if _same(pv, rv):
                        continue
                    if isinstance(pv, list) and isinstance(rv, list) and not _loose(field, pv):
                        self.block(pv, rv, tv, t)
                    elif isinstance(pv, ast.AST) and isinstance(rv, ast.AST):
                        self.node(pv, rv, tv, t)
                    else:
                        raise _Whole
                return
            except _Whole:
                pass
        self.whole(p, r, t, parent)

    def block(self, ps: list, rs: list, ts: list, parent) -> None:
        """The edit of one list (statements, arguments, elements) of the match."""
        aligned = _align(ps, ts)
        k = 0
        while k < min(len(ps), len(rs)) and _same(ps[k], rs[k]):
            k += 1
        m = 0
        while m < min(len(ps), len(rs)) - k and _same(ps[-1 - m], rs[-1 - m]):
            m += 1
        pm, rm = ps[k : len(ps) - m], rs[k : len(rs) - m]
        if len(pm) == len(rm):
            for i, (p, r) in enumerate(zip(pm, rm)):
                a, b = aligned[k + i]
                if _wild(p) or _wild(r) or b != a + 1:
                    raise AnchorError("a ... of the replacement must stand where the pattern's does")
                self.node(p, r, ts[a], parent)
            return
        if any(map(_wild, pm + rm)):
            raise AnchorError("a ... of the replacement must stand where the pattern's does")
        first = aligned[k][0] if k < len(ps) else len(ts)
        last = aligned[k + len(pm) - 1][1] if pm else first
        gone = ts[first:last]
        if not ts or not all(hasattr(x, "lineno") for x in ts + rm):
            raise _Whole
        if not isinstance(ts[0], ast.stmt):
            if not gone or not rm:
                raise _Whole
            for p, t in zip(pm, gone):
                if not _same(p, t):
                    self.whole(p, p, t, parent)  # refuses: the pattern leaves some of it open
            column = self.t.column(gone[0])
            self.edits.append((self.t.span(gone[0])[0], self.t.span(gone[-1])[1], self.text(rm[0], rm[-1], column)))
            return
        for p, t in zip(pm, gone):
            if not _same(p, t):
                self.whole(p, p, t, parent)
        if gone and rm:  # statements replaced
            column = self.t.column(gone[0])
            start, end = self.t.span(gone[0])[0], self.t.span(gone[-1])[1]
            bare = not self.t.source[end : self.t.starts[gone[-1].end_lineno]].strip()
            self.edits.append((start, end, self.text(rm[0], rm[-1], column, comment=bare)))
        elif rm:  # inserted, before the statement that follows or after the one before
            at = ts[first] if first < len(ts) else ts[first - 1]
            column = self.t.column(at)
            text = self.text(rm[0], rm[-1], column, comment=True)
            start, end = self.t.span(at)
            line_end = self.t.starts[at.end_lineno]
            rest = self.t.source[end:line_end].strip()
            if first < len(ts):
                self.edits.append((start, start, text + "\n" + " " * column))
            elif not rest or rest.startswith("#"):  # on a line of their own after it, its comment kept
                self.edits.append((line_end, line_end, " " * column + text + "\n"))
            else:
                self.edits.append((end, end, "\n" + " " * column + text))
        else:  # deleted, their lines with them
            start, end = self.t.span(gone[0])[0], self.t.span(gone[-1])[1]
            line_start = self.t.starts[gone[0].lineno - 1]
            line_end = self.t.starts[gone[-1].end_lineno]
            rest = self.t.source[end:line_end].strip()
            if self.t.source[line_start:start].strip() or (rest and not rest.startswith("#")):
                raise AnchorError(f"the statements deleted at line {gone[0].lineno} share a line with others")
            self.edits.append((line_start, line_end, ""))


def apply(fn: Function, pattern: str, replacement: str) -> str:
    """``fn``'s module with the one match of ``pattern`` in ``fn`` edited into ``replacement``."""
    p, r = _snippet(pattern, "pattern"), _snippet(replacement, "replacement")
    found = _find(fn, p, r)
    if len(found) != 1:
        lines = f" (lines {', '.join(str(m.line) for m in found)})" if found else ""
        raise AnchorError(f"the pattern matches {len(found)} times in {fn.name} ({fn.where}){lines}, expected once")
    match = found[0]
    editor = _Editor(_Text(fn.source), r)
    if match.node is not None:
        parent = next(
            (n for n in ast.walk(fn.node) for c in ast.iter_child_nodes(n) if c is match.node),
            None,
        )
        editor.node(p.expression, r.expression, match.node, parent)
    else:
        editor.block(p.body, r.body, match.block[match.start : match.end], None)
    out = fn.source
    for start, end, text in sorted(editor.edits, reverse=True):
        out = out[:start] + text + out[end:]
    if out == fn.source:
        raise AnchorError("the replacement changes nothing")
    try:
        ast.parse(out)
    except SyntaxError as exc:
        raise AnchorError(f"the mutated {fn.path} does not parse: {exc.msg} (line {exc.lineno})") from None
    return out
