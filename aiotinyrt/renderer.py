"""Renderers: a portable kernel description to C-style source for each backend.

A :class:`Kernel` is a name, typed parameters and a body::

    Kernel(
        "saxpy",
        [BufferParam("out", dtypes.float32, "w"), BufferParam("x", dtypes.float32),
         BufferParam("y", dtypes.float32), IntParam("a")],
        "out[gidx0] = a * x[gidx0] + y[gidx0];",
    )

Everything is checked when the Kernel is built, before any compiler runs: dtypes, parameter
names, and the body (names, types, read/write access). Mistakes raise :class:`KernelError`
(a ``ValueError``) that names the problem and, for the body, its line and column.

The body language
=================

A small subset of C that means the same thing on every backend. The body runs once for every
global index ``(gidx0, gidx1, gidx2)`` in the launch's global size ``(gsz0, gsz1, gsz2)``; all
six are ``int`` and read-only.

* statements: ``buf[i] = e;`` (also ``+= -= *= /= %= &= |= ^= <<= >>=``, ``buf[i]++``),
  local variables ``float32 acc = 0.0f;`` then ``acc += e;``, ``if (c) {...} else {...}``,
  ``for (int k = 0; k < n; k++) {...}`` and ``{ ... }`` blocks;
* expressions: literals (``1``, ``0x10u``, ``2ll``, ``1.5f``, ``1.5``, ``true``), parameters,
  locals, ``buf[i]`` loads, C's unary, binary and ternary operators with C's precedence and C's
  arithmetic conversions, casts ``(int64)x`` and function calls;
* types are dtype names (``float32``, ``float``, ``int``, ``uint8``, ``int64``, ``double``, ...).
  ``float16`` and ``bfloat16`` are storage types: a load gives a ``float32``, a store rounds
  (to nearest even), and they cannot be the type of a local or a cast;
* functions: ``sqrt exp exp2 log log2 sin cos tan tanh floor ceil trunc round fabs`` (one
  float argument, result of its type), ``pow fmin fmax`` (two), and ``min max abs`` on any
  arithmetic type (``a < b ? a : b``, as C macros would be).

C's rules carry over unchanged: an unsuffixed float literal is a ``double`` (write ``1.5f`` for
float32 math on GPUs), integer division and ``%`` truncate toward zero, a float converted to an
integer truncates, a store converts to the buffer's type. A ``float64`` stored to a ``float16``
buffer is rounded through ``float32`` (as tinygrad does).

Buffers are declared ``"r"`` (read only: rendered ``const``), ``"w"`` (write only) or ``"rw"``;
a body that writes a read-only buffer, or reads a write-only one, is rejected. Buffers of one
launch must not overlap (pointers are ``restrict``). Global indices may run concurrently (CPU
threads, GPU work items) in any order: a body should write only elements its own index owns.

Calling conventions
===================

Every rendered kernel takes, in this order: one pointer per buffer parameter (in declaration
order), one ``int`` per int parameter (in declaration order), then ``int gsz0, int gsz1, int
gsz2``, the global size of the launch. :meth:`Kernel.launch_vals` builds the int arguments.

CPU (:class:`ClangRenderer`) appends two more ints::

    void name(<buffers>, <int params>, int gsz0, int gsz1, int gsz2, int core_id, int core_count)

The function loops ``gidx2``, ``gidx1``, ``gidx0`` (innermost) over the global size itself. The
outermost dimension of size > 1 is split into ``core_count`` contiguous, balanced chunks (chunk
``c`` covers ``[n*c/core_count, n*(c+1)/core_count)``) and the call runs chunk ``core_id`` only;
``(core_id, core_count) = (0, 1)`` runs the whole grid. To use every core, call it
``core_count`` times concurrently, each call with its own ``core_id`` (cffi releases the GIL);
:func:`cpu_threads` chooses ``core_count``. A call with ``core_id`` outside ``[0, core_count)``
returns without doing anything.

OpenCL (:class:`OpenCLRenderer`) and CUDA (:class:`CUDARenderer`) kernels take no extra
arguments beyond the global size: each work item computes its ``gidx`` from the hardware ids
(``get_global_id(d)``, ``blockIdx*blockDim+threadIdx``) and returns when it lies outside the
global size, so the launcher may round the grid up to a multiple of the local size. CUDA kernels
are ``extern "C"``; half buffers use ``cuda_fp16.h``; bfloat16 is stored as 16-bit integers and
converted by helpers the kernel carries, identically on every backend. Helpers are guarded, so
kernels rendered for one backend can be concatenated into one compilation unit.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

from aiotinyrt.dtype import ALL_DTYPES, DType, dtypes


class KernelError(ValueError):
    """A :class:`Kernel` is malformed: bad name, dtype or parameter, or a body that does not
    check. Raised when the kernel is built, before anything is compiled."""


# ---- names -------------------------------------------------------------------------------------

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Words a kernel, parameter or local variable may not be called: keywords and reserved words of
#: C, OpenCL C and CUDA C++, the body language's type names, and the names of the convention.
RESERVED_NAMES: frozenset[str] = frozenset(
    " ".join(
        (
            "auto break case char const continue default do double else enum extern float for goto if",
            "inline int long register restrict return short signed sizeof static struct switch typedef",
            "union unsigned void volatile while _Bool _Complex _Imaginary bool true false",
            "half uchar ushort uint ulong kernel global local constant private read_only write_only",
            "read_write image2d_t image3d_t sampler_t event_t size_t ptrdiff_t vload_half vstore_half_rte",
            "get_global_id get_global_size as_float as_uint",
            "class namespace template typename this new delete operator public protected virtual friend",
            "mutable explicit using throw try catch asm threadIdx blockIdx blockDim gridDim warpSize",
            "gidx0 gidx1 gidx2 gsz0 gsz1 gsz2 core_id core_count",
        )
    ).split()
    + [d.name for d in ALL_DTYPES]
)

_GLOBAL_NAMES = ("gidx0", "gidx1", "gidx2", "gsz0", "gsz1", "gsz2")


def _check_name(what: str, name: object) -> str:
    if not isinstance(name, str):
        raise KernelError(f"{what} must be a str, got {type(name).__name__}")
    if not _IDENTIFIER.match(name):
        raise KernelError(f"{what} {name!r} is not a C identifier (letters, digits and _, not first a digit)")
    if name in RESERVED_NAMES or name.startswith(("__", "aiotinyrt_")):
        raise KernelError(
            f"{what} {name!r} is reserved (a keyword of C, OpenCL or CUDA, or of the convention)"
        )
    if name in FUNCTIONS or name.removesuffix("f") in FUNCTIONS:
        raise KernelError(f"{what} {name!r} is the name of a math function")
    return name


def _check_dtype(what: str, dtype: object) -> DType:
    if isinstance(dtype, str):
        try:
            dtype = dtypes.from_name(dtype)
        except ValueError as exc:
            raise KernelError(f"{what}: {exc}") from None
    if not isinstance(dtype, DType):
        raise KernelError(f"{what}: dtype must be a DType or a dtype name, got {type(dtype).__name__}")
    if dtype not in ALL_DTYPES:
        known = ", ".join(d.name for d in ALL_DTYPES)
        raise KernelError(f"{what}: unknown dtype {dtype!r}; known dtypes: {known}")
    return dtype


# ---- parameters --------------------------------------------------------------------------------

Access = Literal["r", "w", "rw"]


@dataclass(frozen=True)
class BufferParam:
    """A buffer parameter: a pointer to elements of ``dtype``; ``access`` is ``"r"`` (default),
    ``"w"`` or ``"rw"``."""

    name: str
    dtype: DType
    access: Access = "r"

    def __post_init__(self) -> None:
        _check_name("buffer parameter name", self.name)
        object.__setattr__(self, "dtype", _check_dtype(f"buffer {self.name!r}", self.dtype))
        if self.access not in ("r", "w", "rw"):
            raise KernelError(f"buffer {self.name!r}: access must be 'r', 'w' or 'rw', got {self.access!r}")

    @property
    def reads(self) -> bool:
        return "r" in self.access

    @property
    def writes(self) -> bool:
        return "w" in self.access


@dataclass(frozen=True)
class IntParam:
    """A 32-bit signed int parameter (passed in a launch's ``vals``)."""

    name: str

    def __post_init__(self) -> None:
        _check_name("int parameter name", self.name)

    @property
    def dtype(self) -> DType:
        return dtypes.int32


Param = BufferParam | IntParam


# ---- body: tokens ------------------------------------------------------------------------------

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+|//[^\n]*|/\*.*?\*/)
  | (?P<float>(?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?[fF]?|\d+[eE][+-]?\d+[fF]?)
  | (?P<int>(?:0[xX][0-9a-fA-F]+|\d+)(?:[uU](?:ll|LL|[lL])?|(?:ll|LL|[lL])[uU]?)?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op><<=|>>=|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^]=|[-+*/%<>=!~&|^?:;,()\[\]{}])
    """,
    re.VERBOSE | re.DOTALL,
)


@dataclass(frozen=True)
class _Token:
    kind: str  # "float", "int", "name", "op", "end"
    text: str
    pos: int


def _tokenize(body: str, where: Callable[[int], str]) -> list[_Token]:
    tokens: list[_Token] = []
    pos = 0
    while pos < len(body):
        match = _TOKEN.match(body, pos)
        if match is None or match.end() == pos:
            raise KernelError(f"{where(pos)}: unexpected character {body[pos]!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind != "ws":
            tokens.append(_Token(kind, match.group(), pos))
        pos = match.end()
    tokens.append(_Token("end", "", len(body)))
    return tokens


# ---- body: typed syntax tree ---------------------------------------------------------------------


@dataclass(frozen=True)
class Expr:
    """A typed expression of a kernel body.

    ``op`` is ``const`` (``arg``: the literal's text), ``var`` (``arg``: the name), ``load``
    (``arg``: the buffer, ``args``: the index), ``unary``/``binary``/``ternary`` (``arg``: the
    operator), ``cast`` (to ``dtype``) or ``call`` (``arg``: the function).
    """

    op: str
    dtype: DType
    arg: str = ""
    args: tuple[Expr, ...] = ()


@dataclass(frozen=True)
class Store:
    """``buffer[index] = value`` (compound assignments are expanded)."""

    buffer: str
    index: Expr
    value: Expr


@dataclass(frozen=True)
class Assign:
    """``name = value`` for a local variable (compound assignments are expanded)."""

    name: str
    value: Expr


@dataclass(frozen=True)
class Decl:
    """``dtype name = value``: a new local variable."""

    dtype: DType
    name: str
    value: Expr


@dataclass(frozen=True)
class If:
    """``if (cond) {then} else {orelse}``."""

    cond: Expr
    then: tuple[Stmt, ...]
    orelse: tuple[Stmt, ...]


@dataclass(frozen=True)
class For:
    """``for (init; cond; step) {body}``."""

    init: Decl
    cond: Expr
    step: Assign
    body: tuple[Stmt, ...]


@dataclass(frozen=True)
class Block:
    """``{ ... }``: a nested scope."""

    body: tuple[Stmt, ...]


Stmt = Store | Assign | Decl | If | For | Block

# ---- body: types -------------------------------------------------------------------------------

_INT_RANK = {
    dtypes.bool: 0,
    dtypes.int8: 1,
    dtypes.uint8: 1,
    dtypes.int16: 2,
    dtypes.uint16: 2,
    dtypes.int32: 3,
    dtypes.uint32: 3,
    dtypes.int64: 4,
    dtypes.uint64: 4,
}
_TO_UNSIGNED = {dtypes.int32: dtypes.uint32, dtypes.int64: dtypes.uint64}
_STORAGE_ONLY = (dtypes.float16, dtypes.bfloat16)


def _promote(dt: DType) -> DType:
    """C's integer promotion; 16-bit floats compute as float32."""
    if dt in _STORAGE_ONLY:
        return dtypes.float32
    if not dt.is_float and _INT_RANK[dt] < 3:
        return dtypes.int32
    return dt


def _arith(a: DType, b: DType) -> DType:
    """C's usual arithmetic conversions."""
    a, b = _promote(a), _promote(b)
    if dtypes.float64 in (a, b):
        return dtypes.float64
    if dtypes.float32 in (a, b):
        return dtypes.float32
    if a == b:
        return a
    if a.is_unsigned == b.is_unsigned:
        return a if _INT_RANK[a] > _INT_RANK[b] else b
    unsigned, signed = (a, b) if a.is_unsigned else (b, a)
    if _INT_RANK[unsigned] >= _INT_RANK[signed]:
        return unsigned
    if _INT_RANK[signed] > _INT_RANK[unsigned]:
        return signed
    return _TO_UNSIGNED[signed]


_UNARY_FLOAT_FUNCS = frozenset(
    [
        "sqrt",
        "exp",
        "exp2",
        "log",
        "log2",
        "sin",
        "cos",
        "tan",
        "tanh",
        "floor",
        "ceil",
        "trunc",
        "round",
        "fabs",
    ]
)
_BINARY_FLOAT_FUNCS = frozenset(("pow", "fmin", "fmax"))
_GENERIC_FUNCS = {"min": 2, "max": 2, "abs": 1}
FUNCTIONS: frozenset[str] = _UNARY_FLOAT_FUNCS | _BINARY_FLOAT_FUNCS | frozenset(_GENERIC_FUNCS)

_ASSIGN_OPS = ("=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>=")
# binary operators by precedence level, loosest first (the ternary and || && are separate)
_BINARY_LEVELS: tuple[tuple[str, ...], ...] = (
    ("||",),
    ("&&",),
    ("|",),
    ("^",),
    ("&",),
    ("==", "!="),
    ("<", "<=", ">", ">="),
    ("<<", ">>"),
    ("+", "-"),
    ("*", "/", "%"),
)
_INT_ONLY_OPS = frozenset(("%", "&", "|", "^", "<<", ">>", "~"))
_BOOL_RESULT_OPS = frozenset(("||", "&&", "==", "!=", "<", "<=", ">", ">=", "!"))


def _int_literal_dtype(text: str) -> DType | None:
    """C's type for an integer literal, or None if it does not fit in 64 bits."""
    lower = text.lower()
    digits = lower.rstrip("ul")
    suffix = lower[len(digits) :]
    try:
        value = int(digits, 16 if digits.startswith("0x") else 8 if digits.startswith("0") else 10)
    except ValueError:
        return None
    decimal = not digits.startswith("0") or digits == "0"
    unsigned, long_ = "u" in suffix, "l" in suffix
    candidates: list[DType] = []
    if not long_:
        candidates += [dtypes.uint32] if unsigned else [dtypes.int32] + ([] if decimal else [dtypes.uint32])
    candidates += [dtypes.uint64] if unsigned else [dtypes.int64] + ([] if decimal else [dtypes.uint64])
    for dt in candidates:
        bits = dt.itemsize * 8
        if value < (2**bits if dt.is_unsigned else 2 ** (bits - 1)):
            return dt
    return None


class _Parser:
    """Recursive descent over the body's tokens; builds the typed tree and checks names, types and
    buffer access as it goes."""

    def __init__(self, kernel_name: str, body: str, params: Sequence[Param]) -> None:
        self.kernel_name = kernel_name
        self.body = body
        self.tokens = _tokenize(body, self.where)
        self.i = 0
        self.buffers = {p.name: p for p in params if isinstance(p, BufferParam)}
        self.ints = {p.name for p in params if isinstance(p, IntParam)}
        self.scopes: list[dict[str, DType]] = [{}]
        self.read: set[str] = set()
        self.written: set[str] = set()
        self.dtypes_used: set[DType] = set()
        self.functions_used: set[tuple[str, DType]] = set()

    # -- helpers
    def where(self, pos: int) -> str:
        line = self.body.count("\n", 0, pos) + 1
        col = pos - (self.body.rfind("\n", 0, pos) + 1) + 1
        return f"kernel {self.kernel_name!r}, body line {line} column {col}"

    def error(self, message: str, token: _Token | None = None) -> KernelError:
        token = token or self.tokens[self.i]
        return KernelError(f"{self.where(token.pos)}: {message}")

    @property
    def tok(self) -> _Token:
        return self.tokens[self.i]

    def peek(self, offset: int = 1) -> _Token:
        return self.tokens[min(self.i + offset, len(self.tokens) - 1)]

    def next(self) -> _Token:
        token = self.tokens[self.i]
        if token.kind != "end":
            self.i += 1
        return token

    def accept(self, text: str) -> bool:
        if self.tok.kind in ("op", "name") and self.tok.text == text:
            self.i += 1
            return True
        return False

    def expect(self, text: str) -> _Token:
        token = self.tok
        if not self.accept(text):
            found = "the end of the body" if token.kind == "end" else repr(token.text)
            raise self.error(f"expected {text!r}, found {found}")
        return token

    def type_name(self, token: _Token) -> DType | None:
        if token.kind != "name":
            return None
        found = getattr(dtypes, token.text, None)
        return found if isinstance(found, DType) else None

    def lookup_local(self, name: str) -> DType | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def declare(self, dtype: DType, token: _Token) -> str:
        name = token.text
        if token.kind != "name" or not _IDENTIFIER.match(name):
            raise self.error(f"expected a variable name, found {name!r}", token)
        if name in self.buffers or name in self.ints or name in _GLOBAL_NAMES:
            raise self.error(f"local variable {name!r} shadows a parameter or a global index", token)
        if name in RESERVED_NAMES or name in FUNCTIONS or name.startswith(("__", "aiotinyrt_")):
            raise self.error(f"{name!r} is reserved and cannot name a local variable", token)
        if self.lookup_local(name) is not None:  # C++ (CUDA) forbids some shadowing C allows
            raise self.error(f"local variable {name!r} is already declared", token)
        if dtype in _STORAGE_ONLY:
            raise self.error(f"{dtype.name} is a storage type; declare the local as float32", token)
        self.scopes[-1][name] = dtype
        self.dtypes_used.add(dtype)
        return name

    def undeclared(self, token: _Token) -> KernelError:
        params = ", ".join([*self.buffers, *sorted(self.ints)]) or "none"
        return self.error(
            f"{token.text!r} is not declared: not a parameter (parameters: {params}), a global "
            f"index (gidx0..gidx2, gsz0..gsz2) or a local variable",
            token,
        )

    # -- statements
    def parse(self) -> tuple[Stmt, ...]:
        stmts = []
        while self.tok.kind != "end":
            stmts.append(self.statement())
        return tuple(stmts)

    def block(self) -> tuple[Stmt, ...]:
        self.scopes.append({})
        try:
            if self.accept("{"):
                stmts = []
                while not self.accept("}"):
                    if self.tok.kind == "end":
                        raise self.error("expected '}', found the end of the body")
                    stmts.append(self.statement())
                return tuple(stmts)
            return (self.statement(),)
        finally:
            self.scopes.pop()

    def statement(self) -> Stmt:
        token = self.tok
        if token.kind == "op" and token.text == "{":
            return Block(self.block())
        if token.kind == "name" and token.text == "if":
            self.next()
            self.expect("(")
            cond = self.expression()
            self.expect(")")
            then = self.block()
            orelse: tuple[Stmt, ...] = ()
            if self.accept("else"):
                orelse = self.block()
            return If(cond, then, orelse)
        if token.kind == "name" and token.text == "for":
            return self.for_loop()
        if token.kind == "name" and token.text in (
            "while",
            "do",
            "return",
            "break",
            "continue",
            "goto",
            "switch",
        ):
            raise self.error(f"{token.text!r} is not part of the kernel body language")
        if self.type_name(token) is not None:
            decl = self.declaration()
            self.expect(";")
            return decl
        stmt = self.assignment()
        self.expect(";")
        return stmt

    def declaration(self) -> Decl:
        dtype = self.type_name(self.next())
        assert dtype is not None
        name_token = self.next()
        self.expect("=")
        value = self.expression()  # parsed before the name is visible, as C scopes it after
        return Decl(dtype, self.declare(dtype, name_token), value)

    def for_loop(self) -> For:
        self.next()
        self.expect("(")
        self.scopes.append({})
        try:
            if self.type_name(self.tok) is None:
                raise self.error("a for loop must declare its variable: for (int k = 0; k < n; k++)")
            init = self.declaration()
            if not init.dtype.is_int:
                raise self.error("a for loop variable must have an integer type")
            self.expect(";")
            cond = self.expression()
            self.expect(";")
            step = self.assignment()
            if not isinstance(step, Assign) or step.name != init.name:
                raise self.error(f"the step of a for loop must update its variable {init.name!r}")
            self.expect(")")
            body = self.block()
        finally:
            self.scopes.pop()
        return For(init, cond, step, body)

    def assignment(self) -> Store | Assign:
        prefix = None
        if self.tok.kind == "op" and self.tok.text in ("++", "--"):
            prefix = self.next().text
        target_token = self.tok
        if target_token.kind != "name":
            raise self.error(f"expected a statement, found {target_token.text or 'the end of the body'!r}")
        self.next()
        name = target_token.text
        index: Expr | None = None
        if name in self.buffers:
            if not (self.tok.kind == "op" and self.tok.text == "["):
                raise self.error(f"buffer {name!r} must be indexed: {name}[i]", target_token)
            self.next()
            index = self.index_expr()
            self.expect("]")
            target_dtype = self.buffers[name].dtype
        elif (local := self.lookup_local(name)) is not None:
            target_dtype = local
        elif name in self.ints or name in _GLOBAL_NAMES:
            raise self.error(f"{name!r} is read-only", target_token)
        elif name in FUNCTIONS or self.type_name(target_token) is not None:
            raise self.error(f"expected a statement, found {name!r}", target_token)
        else:
            raise self.undeclared(target_token)
        if prefix is not None:
            op = prefix
        else:
            op_token = self.next()
            op = op_token.text
            if op_token.kind != "op" or (op not in _ASSIGN_OPS and op not in ("++", "--")):
                raise self.error(f"expected an assignment to {name!r}, found {op!r}", op_token)
        current = Expr("load", _promote(target_dtype), name, (index,)) if index is not None else None
        if current is None:
            current = Expr("var", target_dtype, name)
        if op in ("++", "--"):
            value = self.binary(op[0], current, Expr("const", dtypes.int32, "1"), target_token)
        elif op == "=":
            value = self.expression()
        else:
            value = self.binary(op[:-1], current, self.expression(), target_token)
        if op != "=" and index is not None:
            self.use_buffer(name, target_token, read=True)
        if index is not None:
            self.use_buffer(name, target_token, read=False)
            return Store(name, index, value)
        return Assign(name, value)

    def use_buffer(self, name: str, token: _Token, *, read: bool) -> None:
        param = self.buffers[name]
        if read and not param.reads:
            raise self.error(
                f"buffer {name!r} is declared write-only ('w'); declare it 'rw' to read it", token
            )
        if not read and not param.writes:
            raise self.error(
                f"buffer {name!r} is declared read-only ('r'); declare it 'w' or 'rw' to write it", token
            )
        (self.read if read else self.written).add(name)
        self.dtypes_used.add(param.dtype)

    # -- expressions
    def expression(self) -> Expr:
        cond = self.binary_level(0)
        if self.tok.kind == "op" and self.tok.text == "?":
            self.next()
            then = self.expression()
            self.expect(":")
            orelse = self.expression()
            dtype = (
                dtypes.bool if then.dtype == orelse.dtype == dtypes.bool else _arith(then.dtype, orelse.dtype)
            )
            return Expr("ternary", dtype, "?", (cond, then, orelse))
        return cond

    def binary_level(self, level: int) -> Expr:
        if level == len(_BINARY_LEVELS):
            return self.unary()
        left = self.binary_level(level + 1)
        while self.tok.kind == "op" and self.tok.text in _BINARY_LEVELS[level]:
            token = self.next()
            left = self.binary(token.text, left, self.binary_level(level + 1), token)
        return left

    def binary(self, op: str, a: Expr, b: Expr, token: _Token) -> Expr:
        if op in _INT_ONLY_OPS and (a.dtype.is_float or b.dtype.is_float):
            raise self.error(
                f"operator {op!r} needs integer operands, got {a.dtype.name} and {b.dtype.name}", token
            )
        if op in _BOOL_RESULT_OPS:
            dtype = dtypes.bool
        elif op in ("<<", ">>"):
            dtype = _promote(a.dtype)
        else:
            dtype = _arith(a.dtype, b.dtype)
        self.dtypes_used.add(dtype)
        return Expr("binary", dtype, op, (a, b))

    def unary(self) -> Expr:
        token = self.tok
        if token.kind == "op" and token.text in ("-", "+", "!", "~"):
            self.next()
            x = self.unary()
            if token.text == "~" and x.dtype.is_float:
                raise self.error(f"operator '~' needs an integer operand, got {x.dtype.name}", token)
            dtype = dtypes.bool if token.text == "!" else _promote(x.dtype)
            return Expr("unary", dtype, token.text, (x,))
        if token.kind == "op" and token.text in ("++", "--"):
            raise self.error(f"{token.text!r} is a statement, not an expression", token)
        cast_to = self.type_name(self.peek())
        if token.text == "(" and cast_to is not None and self.peek(2).text == ")":
            self.next()
            type_token = self.next()
            self.next()
            if cast_to in _STORAGE_ONLY:
                raise self.error(
                    f"cannot cast to {cast_to.name}, a storage type: store it to a buffer", type_token
                )
            self.dtypes_used.add(cast_to)
            return Expr("cast", cast_to, "", (self.unary(),))
        return self.postfix()

    def postfix(self) -> Expr:
        value = self.primary()
        if self.tok.kind == "op" and self.tok.text in ("++", "--"):
            raise self.error(f"{self.tok.text!r} is a statement, not an expression")
        return value

    def primary(self) -> Expr:
        token = self.next()
        if token.kind == "int":
            dtype = _int_literal_dtype(token.text)
            if dtype is None:
                raise self.error(
                    f"integer literal {token.text} is malformed or does not fit in 64 bits", token
                )
            self.dtypes_used.add(dtype)
            return Expr("const", dtype, token.text)
        if token.kind == "float":
            dtype = dtypes.float32 if token.text[-1] in "fF" else dtypes.float64
            self.dtypes_used.add(dtype)
            return Expr("const", dtype, token.text)
        if token.kind == "op" and token.text == "(":
            inner = self.expression()
            self.expect(")")
            return inner
        if token.kind != "name":
            found = "the end of the body" if token.kind == "end" else repr(token.text)
            raise self.error(f"expected an expression, found {found}", token)
        name = token.text
        if name in ("true", "false"):
            return Expr("const", dtypes.bool, name)
        if name in self.buffers:
            if not self.accept("["):
                raise self.error(f"buffer {name!r} must be indexed: {name}[i]", token)
            index = self.index_expr()
            self.expect("]")
            self.use_buffer(name, token, read=True)
            return Expr("load", _promote(self.buffers[name].dtype), name, (index,))
        if self.tok.kind == "op" and self.tok.text == "(":
            return self.call(token)
        if name in self.ints or name in _GLOBAL_NAMES:
            return Expr("var", dtypes.int32, name)
        local = self.lookup_local(name)
        if local is not None:
            return Expr("var", local, name)
        if self.type_name(token) is not None:
            raise self.error(f"a type name ({name}) cannot be used as a value; cast with ({name})x", token)
        raise self.undeclared(token)

    def index_expr(self) -> Expr:
        start = self.tok
        index = self.expression()
        if not index.dtype.is_int and index.dtype != dtypes.bool:
            raise self.error(f"an index must be an integer, got {index.dtype.name}", start)
        return index

    def call(self, token: _Token) -> Expr:
        name = token.text
        if name not in FUNCTIONS:
            if name in self.buffers or name in self.ints or name in _GLOBAL_NAMES or self.lookup_local(name):
                raise self.error(f"{name!r} is not a function", token)
            known = ", ".join(sorted(FUNCTIONS))
            raise self.error(f"unknown function {name!r}; known functions: {known}", token)
        self.expect("(")
        args: list[Expr] = []
        if not self.accept(")"):
            args.append(self.expression())
            while self.accept(","):
                args.append(self.expression())
            self.expect(")")
        arity = (
            1 if name in _UNARY_FLOAT_FUNCS else 2 if name in _BINARY_FLOAT_FUNCS else _GENERIC_FUNCS[name]
        )
        if len(args) != arity:
            raise self.error(
                f"{name}() takes {arity} argument{'s' if arity > 1 else ''}, got {len(args)}", token
            )
        if name in _GENERIC_FUNCS:
            dtype = _promote(args[0].dtype) if arity == 1 else _arith(args[0].dtype, args[1].dtype)
            self.dtypes_used.add(dtype)
            return Expr("call", dtype, name, tuple(args))
        for arg in args:
            if not arg.dtype.is_float:
                raise self.error(
                    f"{name}() needs float arguments, got {arg.dtype.name}; cast it: {name}((float32)x)",
                    token,
                )
        dtype = _arith(args[0].dtype, args[-1].dtype)
        self.functions_used.add((name, dtype))
        return Expr("call", dtype, name, tuple(args))


# ---- the kernel --------------------------------------------------------------------------------


def _check_size(what: str, size: object) -> tuple[int, int, int]:
    if isinstance(size, int) or not isinstance(size, Sequence):
        raise TypeError(f"{what} must be a sequence of 1 to 3 ints, got {size!r}")
    if not 1 <= len(size) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {len(size)}")
    dims = list(size)
    for s in dims:
        if type(s) is not int:
            raise TypeError(f"{what} must hold ints, got {s!r}")
        if s <= 0:
            raise ValueError(f"{what} must be positive in every dimension, got {tuple(dims)}")
        if s >= 2**31:
            raise ValueError(f"{what} must be below 2**31 in every dimension, got {tuple(dims)}")
    dims += [1] * (3 - len(dims))
    return dims[0], dims[1], dims[2]


class Kernel:
    """A portable kernel: a name, typed parameters and a body (see the module docstring).

    Built once and checked completely: a bad name, dtype, parameter or body raises
    :class:`KernelError` here, before any compiler runs. ``global_size`` (optional) is the
    default launch size, checked like a launch's.
    """

    def __init__(
        self,
        name: str,
        params: Iterable[Param],
        body: str,
        *,
        global_size: Sequence[int] | None = None,
    ) -> None:
        self.name = _check_name("kernel name", name)
        if isinstance(params, (str, bytes)) or not isinstance(params, Iterable):
            raise KernelError(f"kernel {name!r}: params must be a sequence of BufferParam/IntParam")
        self.params: tuple[Param, ...] = tuple(params)
        seen: set[str] = set()
        for p in self.params:
            if not isinstance(p, (BufferParam, IntParam)):
                raise KernelError(
                    f"kernel {name!r}: parameters must be BufferParam or IntParam, got {type(p).__name__}"
                )
            if p.name in seen:
                raise KernelError(f"kernel {name!r}: parameter {p.name!r} is declared twice")
            if p.name == name:
                raise KernelError(f"kernel {name!r}: a parameter has the kernel's own name")
            seen.add(p.name)
        #: Buffer parameters in declaration order: the order of a launch's buffers.
        self.buffers: tuple[BufferParam, ...] = tuple(p for p in self.params if isinstance(p, BufferParam))
        #: Int parameters in declaration order: the order of a launch's ``vals``.
        self.scalars: tuple[IntParam, ...] = tuple(p for p in self.params if isinstance(p, IntParam))
        #: Indices (into :attr:`buffers`) of the buffers declared written ('w' or 'rw').
        self.writes: tuple[int, ...] = tuple(i for i, b in enumerate(self.buffers) if b.writes)
        if not isinstance(body, str):
            raise KernelError(f"kernel {name!r}: body must be a str, got {type(body).__name__}")
        self.body = body
        self.global_size = None if global_size is None else self._size(global_size)
        parser = _Parser(name, body, self.params)
        try:
            #: The checked, typed body.
            self.statements: tuple[Stmt, ...] = parser.parse()
        except RecursionError:
            raise KernelError(f"kernel {name!r}: the body nests too deeply") from None
        #: Names of the buffers the body actually reads and writes.
        self.read: frozenset[str] = frozenset(parser.read)
        self.written: frozenset[str] = frozenset(parser.written)
        self.dtypes_used: frozenset[DType] = frozenset(parser.dtypes_used | {b.dtype for b in self.buffers})
        self.functions_used: frozenset[tuple[str, DType]] = frozenset(parser.functions_used)

    def __repr__(self) -> str:
        params = ", ".join(
            f"{p.dtype.name}* {p.name} ({p.access})" if isinstance(p, BufferParam) else f"int {p.name}"
            for p in self.params
        )
        return f"<Kernel {self.name}({params})>"

    def _size(self, size: Sequence[int]) -> tuple[int, int, int]:
        try:
            return _check_size(f"kernel {self.name!r}: global_size", size)
        except ValueError as exc:
            raise KernelError(str(exc)) from None

    def launch_size(self, global_size: Sequence[int] | None = None) -> tuple[int, int, int]:
        """The 3-d global size of a launch: ``global_size``, else the kernel's default.

        Raises ``ValueError`` for a zero or negative dimension (or none given), ``TypeError`` for
        a malformed one.
        """
        if global_size is None:
            if self.global_size is None:
                raise KernelError(f"kernel {self.name!r} has no default global_size; pass one to the launch")
            return self.global_size
        return self._size(global_size)

    def launch_vals(self, vals: Sequence[int], global_size: Sequence[int] | None = None) -> tuple[int, ...]:
        """The int arguments of a launch of the rendered kernel: ``vals`` (one per int
        parameter, checked) followed by the global size ``gsz0, gsz1, gsz2``.

        Raises ``TypeError``/``ValueError`` before anything runs.
        """
        if isinstance(vals, (str, bytes)) or not isinstance(vals, Sequence):
            raise TypeError(f"vals must be a sequence of ints, got {type(vals).__name__}")
        if len(vals) != len(self.scalars):
            names = ", ".join(p.name for p in self.scalars) or "none"
            raise TypeError(
                f"kernel {self.name!r} takes {len(self.scalars)} int vals ({names}), got {len(vals)}"
            )
        for p, v in zip(self.scalars, vals, strict=True):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"kernel {self.name!r}: val {p.name} must be an int, got {v!r}")
            if not -(2**31) <= v < 2**31:
                raise ValueError(f"kernel {self.name!r}: val {p.name}={v} does not fit in a 32-bit int")
        return (*vals, *self.launch_size(global_size))

    def check_buffers(self, dtypes_of_buffers: Sequence[DType]) -> None:
        """Check a launch's buffers (by dtype) against the buffer parameters; ``TypeError`` on a
        count or dtype mismatch."""
        if len(dtypes_of_buffers) != len(self.buffers):
            raise TypeError(
                f"kernel {self.name!r} takes {len(self.buffers)} buffers, got {len(dtypes_of_buffers)}"
            )
        for i, (p, dt) in enumerate(zip(self.buffers, dtypes_of_buffers, strict=True)):
            if dt != p.dtype:
                raise TypeError(
                    f"kernel {self.name!r}: buffer {i} ({p.name}) must be {p.dtype.name}, got {dt.name}"
                )


def cpu_threads(global_size: Sequence[int], max_threads: int, min_items_per_thread: int = 1 << 15) -> int:
    """How many threads (``core_count``) a CPU launch of a rendered kernel should use: at most
    ``max_threads``, at most the size of the split dimension, and few enough that each thread
    gets ``min_items_per_thread`` global indices (a thread hand-off costs microseconds)."""
    g0, g1, g2 = _check_size("global_size", global_size)
    split = g2 if g2 > 1 else g1 if g1 > 1 else g0
    total = g0 * g1 * g2
    return max(1, min(max_threads, split, total // max(1, min_items_per_thread)))


# ---- renderers ---------------------------------------------------------------------------------

_INDENT = "  "


class Renderer:
    """Turns a :class:`Kernel` into source for one backend. C-style renderers subclass
    :class:`CStyleRenderer`; a new backend's renderer overrides the type names, the function
    names and the kernel's prologue."""

    #: The backend this renderer writes for (``"CPU"``, ``"OPENCL"``, ``"CUDA"``).
    device: ClassVar[str] = ""
    #: Whether the backend has work groups (a local size); False: the kernel loops itself.
    has_local: ClassVar[bool] = False

    def render(self, kernel: Kernel) -> str:
        """The kernel's full source for this backend."""
        raise NotImplementedError


class CStyleRenderer(Renderer):
    """The shared C-like printer: statements, expressions, loads and stores."""

    #: C spelling of each arithmetic type.
    type_names: ClassVar[dict[DType, str]] = {}
    #: Spelling of a buffer's element type when it differs (16-bit floats, bool).
    storage_names: ClassVar[dict[DType, str]] = {}
    true_false: ClassVar[tuple[str, str]] = ("1", "0")
    int_suffixes: ClassVar[dict[DType, str]] = {
        dtypes.int32: "",
        dtypes.uint32: "u",
        dtypes.int64: "ll",
        dtypes.uint64: "ull",
    }
    bf16_helpers: ClassVar[str] = ""

    def ctype(self, dtype: DType) -> str:
        return self.type_names[dtype]

    def storage_type(self, dtype: DType) -> str:
        return self.storage_names.get(dtype, self.type_names.get(dtype, ""))

    def math_function(self, name: str, dtype: DType) -> str:
        """The backend's name of float function ``name`` at ``dtype`` (float32 or float64)."""
        return name

    # -- expressions
    def expr(self, e: Expr, kernel: Kernel) -> str:
        if e.op == "const":
            if e.dtype == dtypes.bool:
                return self.true_false[0] if e.arg == "true" else self.true_false[1]
            if e.dtype.is_int:  # the literal's digits with this language's suffix for its type
                return e.arg.rstrip("uUlL") + self.int_suffixes[e.dtype]
            return e.arg
        if e.op == "var":
            return e.arg
        if e.op == "load":
            param = next(b for b in kernel.buffers if b.name == e.arg)
            return self.load(param, self.expr(e.args[0], kernel))
        args = [self.expr(a, kernel) for a in e.args]
        if e.op == "unary":
            return f"({e.arg}{args[0]})"
        if e.op == "binary":
            return f"({args[0]} {e.arg} {args[1]})"
        if e.op == "ternary":
            return f"({args[0]} ? {args[1]} : {args[2]})"
        if e.op == "cast":
            return f"(({self.ctype(e.dtype)}){args[0]})"
        if e.op == "call":
            if e.arg in _GENERIC_FUNCS:
                if e.arg == "abs":
                    x = f"(({self.ctype(e.dtype)}){args[0]})"
                    return f"({x} < 0 ? -{x} : {x})"
                a, b = (f"(({self.ctype(e.dtype)}){x})" for x in args)
                return f"({a} {'<' if e.arg == 'min' else '>'} {b} ? {a} : {b})"
            fn = self.math_function(e.arg, e.dtype)
            return f"{fn}({', '.join(f'(({self.ctype(e.dtype)}){a})' for a in args)})"
        raise AssertionError(f"unknown expression {e.op}")

    def load(self, buf: BufferParam, index: str) -> str:
        """A load of ``buf[index]`` as a value of the buffer's compute type."""
        if buf.dtype == dtypes.bfloat16:
            return f"aiotinyrt_bf16_to_f32({buf.name}[{index}])"
        return f"{buf.name}[{index}]"

    def store(self, buf: BufferParam, index: str, value: str) -> str:
        """A statement storing ``value`` (of any arithmetic type) to ``buf[index]``."""
        if buf.dtype == dtypes.bfloat16:
            return f"{buf.name}[{index}] = aiotinyrt_f32_to_bf16((float){value});"
        return f"{buf.name}[{index}] = {value};"

    # -- statements
    def statements(self, stmts: Sequence[Stmt], kernel: Kernel, depth: int) -> list[str]:
        pad = _INDENT * depth
        lines: list[str] = []
        for s in stmts:
            if isinstance(s, Store):
                param = next(b for b in kernel.buffers if b.name == s.buffer)
                lines.append(pad + self.store(param, self.expr(s.index, kernel), self.expr(s.value, kernel)))
            elif isinstance(s, Assign):
                lines.append(f"{pad}{s.name} = {self.expr(s.value, kernel)};")
            elif isinstance(s, Decl):
                lines.append(f"{pad}{self.ctype(s.dtype)} {s.name} = {self.expr(s.value, kernel)};")
            elif isinstance(s, If):
                lines.append(f"{pad}if ({self.expr(s.cond, kernel)}) {{")
                lines += self.statements(s.then, kernel, depth + 1)
                if s.orelse:
                    lines.append(f"{pad}}} else {{")
                    lines += self.statements(s.orelse, kernel, depth + 1)
                lines.append(pad + "}")
            elif isinstance(s, For):
                init = f"{self.ctype(s.init.dtype)} {s.init.name} = {self.expr(s.init.value, kernel)}"
                step = f"{s.step.name} = {self.expr(s.step.value, kernel)}"
                lines.append(f"{pad}for ({init}; {self.expr(s.cond, kernel)}; {step}) {{")
                lines += self.statements(s.body, kernel, depth + 1)
                lines.append(pad + "}")
            else:
                lines.append(pad + "{")
                lines += self.statements(s.body, kernel, depth + 1)
                lines.append(pad + "}")
        return lines

    def params(self, kernel: Kernel, buffer_prefix: str = "", restrict: str = "restrict") -> list[str]:
        out = []
        for b in kernel.buffers:
            const = "" if b.writes else "const "
            out.append(f"{buffer_prefix}{const}{self.storage_type(b.dtype)}* {restrict} {b.name}")
        out += [f"const int {p.name}" for p in kernel.scalars]
        out += [f"const int {g}" for g in ("gsz0", "gsz1", "gsz2")]
        return out

    def helpers(self, kernel: Kernel) -> list[str]:
        """Definitions the kernel needs, each guarded so that rendered kernels can be
        concatenated into one compilation unit."""
        if dtypes.bfloat16 not in kernel.dtypes_used:
            return []
        return ["#ifndef AIOTINYRT_BF16", "#define AIOTINYRT_BF16", self.bf16_helpers, "#endif"]


_BF16_DOC = "/* bfloat16 is stored as uint16: the top half of a float32, rounded to nearest even */"


# C and CUDA spell the arithmetic types the same way (DType.cname); f16/bf16 are storage types
_C_TYPE_NAMES: dict[DType, str] = {
    dt: dt.cname for dt in ALL_DTYPES if dt not in (dtypes.float16, dtypes.bfloat16)
}


class ClangRenderer(CStyleRenderer):
    """C for the CPU backend (clang or gcc). The kernel loops over the global size and takes
    ``core_id, core_count`` to split it across threads (see the module docstring)."""

    device: ClassVar[str] = "CPU"
    has_local: ClassVar[bool] = False
    type_names: ClassVar[dict[DType, str]] = {**_C_TYPE_NAMES, dtypes.bool: "_Bool"}
    storage_names: ClassVar[dict[DType, str]] = {
        dtypes.float16: "aiotinyrt_half",
        dtypes.bfloat16: "unsigned short",
    }
    #: clang has the storage-only ``__fp16`` on every target; gcc has ``_Float16`` on x86 and arm
    half_typedef: ClassVar[str] = "\n".join(
        (
            "#ifndef AIOTINYRT_HALF",
            "#define AIOTINYRT_HALF",
            "#if defined(__clang__)",
            "typedef __fp16 aiotinyrt_half;",
            "#else",
            "typedef _Float16 aiotinyrt_half;",
            "#endif",
            "#endif",
        )
    )
    bf16_helpers: ClassVar[str] = f"""{_BF16_DOC}
static inline __attribute__((unused)) float aiotinyrt_bf16_to_f32(unsigned short h) {{
  unsigned int u = (unsigned int)h << 16; float f; __builtin_memcpy(&f, &u, 4); return f;
}}
static inline __attribute__((unused)) unsigned short aiotinyrt_f32_to_bf16(float f) {{
  unsigned int u; __builtin_memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}}"""

    def math_function(self, name: str, dtype: DType) -> str:
        return f"__builtin_{name}{'f' if dtype == dtypes.float32 else ''}"

    def load(self, buf: BufferParam, index: str) -> str:
        if buf.dtype == dtypes.float16:
            return f"((float){buf.name}[{index}])"
        return super().load(buf, index)

    def store(self, buf: BufferParam, index: str, value: str) -> str:
        if buf.dtype == dtypes.float16:  # through float32, as tinygrad does: x86 has no double->half
            return f"{buf.name}[{index}] = (aiotinyrt_half)(float){value};"
        return super().store(buf, index, value)

    def render(self, kernel: Kernel) -> str:
        """C source: ``void name(<buffers>, <ints>, gsz0, gsz1, gsz2, core_id, core_count)``."""
        signature = ", ".join([*self.params(kernel), "const int core_id", "const int core_count"])
        body = "\n".join(self.statements(kernel.statements, kernel, 4))
        prefix = [self.half_typedef] if dtypes.float16 in kernel.dtypes_used else []
        lines = [
            *prefix,
            *self.helpers(kernel),
            f"void {kernel.name}({signature}) {{",
            "  if (core_id < 0 || core_id >= core_count) return;",
            "  /* split the outermost dimension of size > 1 into core_count chunks; run chunk core_id */",
            "  const int aiotinyrt_dim = gsz2 > 1 ? 2 : gsz1 > 1 ? 1 : 0;",
            "  const long long aiotinyrt_n = aiotinyrt_dim == 2 ? gsz2 : aiotinyrt_dim == 1 ? gsz1 : gsz0;",
            "  const int aiotinyrt_lo = (int)(aiotinyrt_n * core_id / core_count);",
            "  const int aiotinyrt_hi = (int)(aiotinyrt_n * (core_id + 1) / core_count);",
        ]
        for d in (2, 1, 0):
            lines.append(
                f"  const int aiotinyrt_lo{d} = aiotinyrt_dim == {d} ? aiotinyrt_lo : 0, "
                f"aiotinyrt_hi{d} = aiotinyrt_dim == {d} ? aiotinyrt_hi : gsz{d};"
            )
        for depth, d in enumerate((2, 1, 0), start=1):
            loop = f"int gidx{d} = aiotinyrt_lo{d}; gidx{d} < aiotinyrt_hi{d}; gidx{d}++"
            lines.append(f"{_INDENT * depth}for ({loop}) {{")
        lines.append(body)
        lines += [f"{_INDENT * depth}}}" for depth in (3, 2, 1)]
        lines.append("}")
        return "\n".join(lines) + "\n"


class OpenCLRenderer(CStyleRenderer):
    """OpenCL C. One work item per global index; items outside the global size return at once,
    so the launcher may round the NDRange up to a multiple of the local size."""

    device: ClassVar[str] = "OPENCL"
    has_local: ClassVar[bool] = True
    type_names: ClassVar[dict[DType, str]] = {
        dtypes.bool: "bool",
        dtypes.int8: "char",
        dtypes.uint8: "uchar",
        dtypes.int16: "short",
        dtypes.uint16: "ushort",
        dtypes.int32: "int",
        dtypes.uint32: "uint",
        dtypes.int64: "long",
        dtypes.uint64: "ulong",
        dtypes.float32: "float",
        dtypes.float64: "double",
    }
    # bool is not allowed in kernel arguments: bool buffers are bytes
    storage_names: ClassVar[dict[DType, str]] = {
        dtypes.bool: "uchar",
        dtypes.float16: "half",
        dtypes.bfloat16: "ushort",
    }
    true_false: ClassVar[tuple[str, str]] = ("true", "false")
    int_suffixes: ClassVar[dict[DType, str]] = {
        dtypes.int32: "",
        dtypes.uint32: "u",
        dtypes.int64: "l",
        dtypes.uint64: "ul",
    }
    bf16_helpers: ClassVar[str] = f"""{_BF16_DOC}
inline float aiotinyrt_bf16_to_f32(ushort h) {{ return as_float((uint)h << 16); }}
inline ushort aiotinyrt_f32_to_bf16(float f) {{
  uint u = as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (ushort)((u >> 16) | 0x40u);
  return (ushort)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}}"""

    def load(self, buf: BufferParam, index: str) -> str:
        if buf.dtype == dtypes.float16:  # vload_half needs no cl_khr_fp16
            return f"vload_half({index}, {buf.name})"
        if buf.dtype == dtypes.bool:
            return f"({buf.name}[{index}] != 0)"
        return super().load(buf, index)

    def store(self, buf: BufferParam, index: str, value: str) -> str:
        if buf.dtype == dtypes.float16:
            return f"vstore_half_rte((float){value}, {index}, {buf.name});"
        if buf.dtype == dtypes.bool:
            return f"{buf.name}[{index}] = (uchar)({value} != 0);"
        return super().store(buf, index, value)

    def render(self, kernel: Kernel) -> str:
        """OpenCL C source: ``__kernel void name(<buffers>, <ints>, gsz0, gsz1, gsz2)``."""
        prefix = []
        if dtypes.float64 in kernel.dtypes_used:
            prefix.append("#pragma OPENCL EXTENSION cl_khr_fp64 : enable")
        signature = ", ".join(self.params(kernel, "__global "))
        lines = [*prefix, *self.helpers(kernel), f"__kernel void {kernel.name}({signature}) {{"]
        lines += [f"  const int gidx{d} = (int)get_global_id({d});" for d in range(3)]
        lines.append("  if (gidx0 >= gsz0 || gidx1 >= gsz1 || gidx2 >= gsz2) return;")
        lines += self.statements(kernel.statements, kernel, 1)
        lines.append("}")
        return "\n".join(lines) + "\n"


class CUDARenderer(CStyleRenderer):
    """CUDA C++ (``extern "C"`` kernels, for NVRTC or nvcc). One thread per global index;
    threads outside the global size return at once."""

    device: ClassVar[str] = "CUDA"
    has_local: ClassVar[bool] = True
    type_names: ClassVar[dict[DType, str]] = _C_TYPE_NAMES
    storage_names: ClassVar[dict[DType, str]] = {dtypes.float16: "half", dtypes.bfloat16: "unsigned short"}
    true_false: ClassVar[tuple[str, str]] = ("true", "false")
    bf16_helpers: ClassVar[str] = f"""{_BF16_DOC}
__device__ __forceinline__ float aiotinyrt_bf16_to_f32(unsigned short h) {{
  return __uint_as_float((unsigned int)h << 16);
}}
__device__ __forceinline__ unsigned short aiotinyrt_f32_to_bf16(float f) {{
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}}"""

    def math_function(self, name: str, dtype: DType) -> str:
        return f"{name}{'f' if dtype == dtypes.float32 else ''}"

    def load(self, buf: BufferParam, index: str) -> str:
        if buf.dtype == dtypes.float16:
            return f"__half2float({buf.name}[{index}])"
        return super().load(buf, index)

    def store(self, buf: BufferParam, index: str, value: str) -> str:
        if buf.dtype == dtypes.float16:
            return f"{buf.name}[{index}] = __float2half_rn((float){value});"
        return super().store(buf, index, value)

    def render(self, kernel: Kernel) -> str:
        """CUDA source: ``extern "C" __global__ void name(<buffers>, <ints>, gsz0, gsz1, gsz2)``."""
        prefix = ["#include <cuda_fp16.h>"] if dtypes.float16 in kernel.dtypes_used else []
        signature = ", ".join(self.params(kernel, restrict="__restrict__"))
        lines = [*prefix, *self.helpers(kernel), f'extern "C" __global__ void {kernel.name}({signature}) {{']
        lines += [
            f"  const int gidx{d} = (int)(blockIdx.{xyz} * blockDim.{xyz} + threadIdx.{xyz});"
            for d, xyz in enumerate("xyz")
        ]
        lines.append("  if (gidx0 >= gsz0 || gidx1 >= gsz1 || gidx2 >= gsz2) return;")
        lines += self.statements(kernel.statements, kernel, 1)
        lines.append("}")
        return "\n".join(lines) + "\n"


RENDERERS: dict[str, type[CStyleRenderer]] = {
    "CPU": ClangRenderer,
    "OPENCL": OpenCLRenderer,
    "CUDA": CUDARenderer,
}


def render(kernel: Kernel, device: str = "CPU") -> str:
    """Render ``kernel`` for backend ``device`` (``"CPU"``, ``"OPENCL"`` or ``"CUDA"``)."""
    backend = device.partition(":")[0].upper()
    try:
        renderer = RENDERERS[backend]
    except KeyError:
        raise ValueError(f"no renderer for {device!r}; renderers: {', '.join(RENDERERS)}") from None
    return renderer().render(kernel)


__all__ = [
    "FUNCTIONS",
    "RESERVED_NAMES",
    "Assign",
    "Block",
    "BufferParam",
    "CStyleRenderer",
    "CUDARenderer",
    "ClangRenderer",
    "Decl",
    "Expr",
    "For",
    "If",
    "IntParam",
    "Kernel",
    "KernelError",
    "OpenCLRenderer",
    "Param",
    "Renderer",
    "Store",
    "cpu_threads",
    "render",
]
