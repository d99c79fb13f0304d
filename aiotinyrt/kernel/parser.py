"""The kernel-body language, read by pycparser and checked into the typed tree of
:mod:`aiotinyrt.kernel.tree`.

The body is C99 statements. It is wrapped in a synthetic function after ``typedef``s of the
dtype names (``typedef int float32;`` ...: only a typedef name parses as a type), read by
pycparser's ``CParser``, and its syntax tree is walked: every name, type and buffer access is
checked, C's arithmetic conversions give every expression its dtype, and anything outside the
language is rejected with a :class:`KernelError` naming the body's line and column.

Before pycparser sees it the body is cleaned without moving a character: comments become spaces
(pycparser expects preprocessed input), other whitespace becomes a space (pycparser knows only
space, tab and newline), and a character the language has no use for (``#``, quotes, ``$``,
``@``, non-ASCII) is rejected, so pycparser never reads a directive or a string.

``_BodyParser`` hooks four of ``CParser``'s methods, each for one rule of the language that C's
grammar does not give: an expected token is named in the error (``expected ';'``); a
parenthesised expression is remembered (``(x) = 1`` and ``(sqrt)(x)`` are not the language, and
C's tree drops the parentheses); a statement starts with a name, ``{``, ``++`` or ``--``; and a
declaration may stand as the body of ``if``/``else``/``for`` (the language scopes it there). The
names of parameters and of ``gidx0``... need no declaration: pycparser does not resolve names,
the walk does.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NoReturn

from pycparser import c_ast
from pycparser.c_parser import CParser, ParseError

from aiotinyrt.dtype import DType
from aiotinyrt.kernel.ctype import TYPE_NAMES
from aiotinyrt.kernel.params import IDENTIFIER, KernelError, Param
from aiotinyrt.kernel.tree import Stmt
from aiotinyrt.kernel.walk import Walker

_C_KEYWORD_TYPES = frozenset(("char", "double", "float", "int", "long", "short"))
_WRAPPER = "aiotinyrt_body"
_TYPEDEF_NAMES = sorted(n for n in TYPE_NAMES if n not in _C_KEYWORD_TYPES)
_TYPEDEF_NAME = re.compile(r"\b(?:" + "|".join(_TYPEDEF_NAMES) + r")\b")

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_SPACE = re.compile(r"[^\S\n]")
_UNEXPECTED = re.compile(r"[^A-Za-z0-9_.+\-*/%<>=!~&|^?:;,()\[\]{}\n ]")
_NUMBER = re.compile(r"[0-9A-Za-z_.]+")
_TOKEN_TEXT = {
    "SEMI": ";",
    "LPAREN": "(",
    "RPAREN": ")",
    "LBRACKET": "[",
    "RBRACKET": "]",
    "LBRACE": "{",
    "RBRACE": "}",
    "COLON": ":",
    "COMMA": ",",
    "EQUALS": "=",
    "WHILE": "while",
}


class _Expected(Exception):
    """``what`` was expected where ``token`` (None: the end of the input) stands."""

    def __init__(self, what: str, token: Any) -> None:
        super().__init__(what)
        self.what = what
        self.token = token


class _TypeAsValue(Exception):
    """A type name stands where a value was expected."""

    def __init__(self, token: Any) -> None:
        super().__init__(token.value)
        self.token = token


class _BodyParser(CParser):  # type: ignore[misc]  # pycparser ships no type information
    """pycparser's parser with the four hooks the module docstring lists."""

    def __init__(self) -> None:
        super().__init__()
        #: id(node) -> (node, line, column of its '('), for every parenthesised expression
        self.parens: dict[int, tuple[Any, int, int]] = {}
        #: ids of the Decls after the first of one declaration (``int a = 1, b = 2``)
        self.multi: set[int] = set()

    def parse_text(self, text: str) -> Any:
        """pycparser's tree of ``text``; the parentheses and declarations it saw are recorded."""
        self.parens, self.multi = {}, set()
        return self.parse(text, "body")

    def _expect(self, token_type: str) -> Any:
        token = self._peek()
        if token is None or token.type != token_type:
            raise _Expected(repr(_TOKEN_TEXT.get(token_type, token_type.lower())), token)
        return self._advance()

    def _parse_primary_expression(self) -> Any:
        token = self._peek()
        if token is not None and token.type == "LPAREN":
            node = super()._parse_primary_expression()
            self.parens[id(node)] = (node, token.lineno, token.column)
            return node
        if token is not None and (token.type == "TYPEID" or token.value in _C_KEYWORD_TYPES):
            raise _TypeAsValue(token)
        if token is None or not (token.type == "ID" or token.type.startswith(("INT_CONST", "FLOAT_CONST"))):
            raise _Expected("an expression", token)
        return super()._parse_primary_expression()

    def _parse_statement(self) -> Any:
        token = self._peek()
        if token is not None and self._starts_declaration():
            return c_ast.Compound(self._parse_declaration(), self._tok_coord(token))
        if token is None or not (
            token.type in ("LBRACE", "PLUSPLUS", "MINUSMINUS") or IDENTIFIER.match(token.value)
        ):
            raise _Expected("a statement", token)
        return super()._parse_statement()

    def _parse_declaration(self) -> Any:
        decls = super()._parse_declaration()
        self.multi.update(id(d) for d in decls[1:])
        return decls


_local = threading.local()


def _parser() -> _BodyParser:
    parser: _BodyParser | None = getattr(_local, "parser", None)
    if parser is None:
        parser = _local.parser = _BodyParser()
    return parser


@dataclass(frozen=True)
class ParsedBody:
    """A checked body: its statements and what they use."""

    statements: tuple[Stmt, ...]
    read: frozenset[str]
    written: frozenset[str]
    dtypes_used: frozenset[DType]
    functions_used: frozenset[tuple[str, DType]]


def clean(body: str) -> str:
    """``body`` with comments and whitespace turned into spaces (newlines kept, so every character
    keeps its line and column)."""
    text = _COMMENT.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), body)
    return _SPACE.sub(" ", text)


@lru_cache(maxsize=1024)
def parse_body(kernel_name: str, body: str, params: tuple[Param, ...]) -> ParsedBody:
    """Parse and check ``body`` (cached per process: a kernel built twice is parsed once).

    Raises :class:`KernelError` naming the first problem and its line and column.
    """
    walker = Walker(kernel_name, body, clean(body), params)
    try:
        statements = _walk(walker)
    except RecursionError:
        raise KernelError(f"kernel {kernel_name!r}: the body nests too deeply") from None
    return ParsedBody(
        statements,
        frozenset(walker.read),
        frozenset(walker.written),
        frozenset(walker.dtypes_used),
        frozenset(walker.functions_used),
    )


def _walk(walker: Walker) -> tuple[Stmt, ...]:
    text = walker.text
    bad = _UNEXPECTED.search(text)
    if bad is not None:
        raise walker.error(f"unexpected character {walker.body[bad.start()]!r}", walker.position(bad.start()))
    parser = _parser()
    try:
        ast = parser.parse_text(_prelude(text) + text + "\n}\n")
    except _Expected as exc:
        token = exc.token
        if token is None or token.lineno - 1 > len(walker.lines):
            _stray_brace(walker, len(text))
            raise walker.error(f"expected {exc.what}, found the end of the body", walker.end()) from None
        pos = (token.lineno - 1, token.column)
        _stray_brace(walker, walker.offset(pos))
        raise walker.error(f"expected {exc.what}, found {token.value!r}", pos) from None
    except _TypeAsValue as exc:
        name, pos = exc.token.value, (exc.token.lineno - 1, exc.token.column)
        _stray_brace(walker, walker.offset(pos))
        message = f"a type name ({name}) cannot be used as a value; cast with ({name})x"
        raise walker.error(message, pos) from None
    except ParseError as exc:
        _pycparser_error(walker, str(exc))
    except AssertionError:  # pycparser's scope stack, emptied by a '}' of the body
        _stray_brace(walker, len(text))
        raise
    except ValueError as exc:  # pycparser's check of an integer literal's suffix
        raise KernelError(f"kernel {walker.kernel_name!r}: {exc}") from None
    walker.parens, walker.multi = parser.parens, parser.multi
    func = ast.ext[-1]
    if not isinstance(func, c_ast.FuncDef) or func.decl.name != _WRAPPER:
        _stray_brace(walker, len(text))  # a '}' of the body closed the synthetic function
    return walker.items(func.body)


def _prelude(text: str) -> str:
    """The first line of the synthetic source: a typedef of each dtype name the body uses (only
    a typedef name parses as a type; declaring the unused ones would triple a short body's
    parse time), then the wrapper function's head."""
    used = sorted(set(_TYPEDEF_NAME.findall(text)))
    return "".join(f"typedef int {n}; " for n in used) + f"void {_WRAPPER}(void) {{\n"


def _stray_brace(walker: Walker, before: int) -> None:
    """Raise for the first '}' that closes more than the body opened, if one stands before offset
    ``before``: it ended the synthetic function early, and whatever pycparser said after it is
    about the wrapper, not the body."""
    depth = 0
    for i, ch in enumerate(walker.text[:before]):
        if ch == "{":
            depth += 1
        elif ch == "}":
            if depth == 0:
                raise walker.error("expected a statement, found '}'", walker.position(i))
            depth -= 1


def _pycparser_error(walker: Walker, message: str) -> NoReturn:
    """A KernelError for one of pycparser's own errors (``body:LINE:COL: what``)."""
    match = re.match(r"body:(\d+):(\d+): (.*)", message, re.DOTALL)
    pos = walker.end() if match is None else (int(match.group(1)) - 1, int(match.group(2)))
    if pos[0] > len(walker.lines):
        pos = walker.end()
    _stray_brace(walker, walker.offset(pos))
    what = "unexpected end of the body" if match is None else match.group(3)
    if what.startswith("Invalid octal"):
        literal = _NUMBER.match(walker.text, walker.offset(pos))
        text = literal.group() if literal else "?"
        raise walker.error(f"integer literal {text} is malformed or does not fit in 64 bits", pos)
    if what.startswith("Comments are not supported"):
        raise walker.error("unterminated comment: '/*' without '*/'", pos)
    if what.startswith("Invalid declaration"):
        raise walker.error("expected a variable name: a declaration is dtype name = value;", pos)
    raise walker.error(f"syntax error: {what}", pos)
