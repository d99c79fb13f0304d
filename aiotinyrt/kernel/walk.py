"""The checks of the body language, as a walk over pycparser's syntax tree of one body.

:class:`Walker` turns the tree into :mod:`aiotinyrt.kernel.tree` nodes, checking names, scopes,
types and buffer access in source order, so the first problem in the body is the one reported.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from pycparser import c_ast

from aiotinyrt.dtype import DType, dtypes
from aiotinyrt.kernel import ctype
from aiotinyrt.kernel.params import (
    BINARY_FLOAT_FUNCS,
    FUNCTIONS,
    GENERIC_FUNCS,
    GLOBAL_NAMES,
    RESERVED_NAMES,
    UNARY_FLOAT_FUNCS,
    BufferParam,
    IntParam,
    KernelError,
    Param,
)
from aiotinyrt.kernel.tree import Assign, Block, Decl, Expr, For, If, Stmt, Store

_INT_TEXT = re.compile(r"(?:0[xX][0-9a-fA-F]+|[0-9]+)(?:[uU](?:ll|LL|[lL])?|(?:ll|LL|[lL])[uU]?)?\Z")
_FLOAT_TEXT = re.compile(r"(?:(?:[0-9]+\.[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[0-9]+[eE][+-]?[0-9]+)[fF]?\Z")
_NEXT_TOKEN = re.compile(r"\s*(<<=|>>=|\+\+|--|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%&|^]=|[A-Za-z0-9_.]+|\S)")
_NOT_IN_LANGUAGE: dict[type, str] = {
    c_ast.While: "while",
    c_ast.DoWhile: "do",
    c_ast.Return: "return",
    c_ast.Break: "break",
    c_ast.Continue: "continue",
    c_ast.Goto: "goto",
    c_ast.Switch: "switch",
    c_ast.Case: "case",
    c_ast.Default: "default",
}
Pos = tuple[int, int]


class Walker:
    """One body: its cleaned text (for positions), its parameters, scopes and what it uses.

    ``parens`` maps id(node) to (node, line, column of its '(') for parenthesised expressions;
    ``multi`` holds the ids of Decls after the first of one declaration. Lines count from the
    body's first line (the parser's line minus one: the prelude's line).
    """

    def __init__(self, kernel_name: str, body: str, text: str, params: Sequence[Param]) -> None:
        self.kernel_name = kernel_name
        self.body = body
        self.text = text
        self.lines = text.split("\n")
        self.buffers = {p.name: p for p in params if isinstance(p, BufferParam)}
        self.ints = {p.name for p in params if isinstance(p, IntParam)}
        self.scopes: list[dict[str, DType]] = [{}]
        self.read: set[str] = set()
        self.written: set[str] = set()
        self.dtypes_used: set[DType] = set()
        self.functions_used: set[tuple[str, DType]] = set()
        self.parens: dict[int, tuple[Any, int, int]] = {}
        self.multi: set[int] = set()

    # -- positions
    def offset(self, pos: Pos) -> int:
        """The offset in the body of a (line, column) position."""
        return sum(len(s) + 1 for s in self.lines[: pos[0] - 1]) + pos[1] - 1

    def position(self, offset: int) -> Pos:
        """The (line, column) position of an offset in the body."""
        return self.text.count("\n", 0, offset) + 1, offset - (self.text.rfind("\n", 0, offset) + 1) + 1

    def end(self) -> Pos:
        """The position just past the body's last character."""
        return len(self.lines), len(self.lines[-1]) + 1

    def at(self, node: Any) -> Pos:
        """The position pycparser gives ``node`` (its first operand's, for an operator)."""
        coord = getattr(node, "coord", None)
        if coord is None or not getattr(coord, "column", None):
            return 1, 1
        return coord.line - 1, coord.column

    def error(self, message: str, pos: Pos) -> KernelError:
        """A KernelError for ``message`` at ``pos`` of this kernel's body."""
        return KernelError(f"kernel {self.kernel_name!r}, body line {pos[0]} column {pos[1]}: {message}")

    def token_after(self, offset: int) -> tuple[str, Pos]:
        """The next token at or after ``offset``, quoted as an error message names it, and its
        position."""
        match = _NEXT_TOKEN.match(self.text, offset)
        if match is None:
            return "the end of the body", self.end()
        return repr(match.group(1)), self.position(match.start(1))

    def start(self, node: Any) -> int:
        """The offset of the first character of ``node``'s source (pycparser's coordinate of an
        operator's node is its first operand's, and parentheses leave no node)."""
        where = self.paren(node)
        if where is not None:
            return self.offset(where)
        if isinstance(node, c_ast.BinaryOp):
            return self.start(node.left)
        if isinstance(node, c_ast.TernaryOp):
            return self.start(node.cond)
        if isinstance(node, c_ast.Assignment):
            return self.start(node.lvalue)
        if isinstance(node, (c_ast.ArrayRef, c_ast.FuncCall, c_ast.StructRef)):
            return self.start(node.name)
        if isinstance(node, c_ast.ExprList):
            return self.start(node.exprs[0])
        if isinstance(node, c_ast.UnaryOp) and node.op in ("-", "+", "!", "~", "&", "*", "++", "--"):
            return self.text.rindex(node.op, 0, self.start(node.expr))
        return self.offset(self.at(node))

    def before(self, text: str, node: Any) -> Pos:
        """The position of the operator ``text`` written just before ``node``."""
        return self.position(self.text.rindex(text, 0, self.start(node)))

    def after_brackets(self, offset: int) -> int:
        """The offset just past the ']' that closes the first '[' at or after ``offset``."""
        depth, i = 0, self.text.index("[", offset)
        while i < len(self.text):
            depth += {"[": 1, "]": -1}.get(self.text[i], 0)
            i += 1
            if depth == 0:
                break
        return i

    def paren(self, node: Any) -> Pos | None:
        """The position of the '(' around ``node``, if it was written in parentheses."""
        found = self.parens.get(id(node))
        return None if found is None else (found[1] - 1, found[2])

    # -- names and scopes
    def lookup_local(self, name: str) -> DType | None:
        """The dtype of local ``name`` in the innermost scope that has it, or None."""
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def declare(self, dtype: DType, name: str, pos: Pos) -> str:
        """Declare local ``name`` in the current scope, after the checks a new name must pass."""
        if name in self.buffers or name in self.ints or name in GLOBAL_NAMES:
            raise self.error(f"local variable {name!r} shadows a parameter or a global index", pos)
        if name in RESERVED_NAMES or name in FUNCTIONS or name.startswith(("__", "aiotinyrt_")):
            raise self.error(f"{name!r} is reserved and cannot name a local variable", pos)
        if self.lookup_local(name) is not None:  # C++ (CUDA) forbids some shadowing C allows
            raise self.error(f"local variable {name!r} is already declared", pos)
        if dtype in ctype.STORAGE_ONLY:
            raise self.error(f"{dtype.name} is a storage type; declare the local as float32", pos)
        self.scopes[-1][name] = dtype
        self.dtypes_used.add(dtype)
        return name

    def undeclared(self, name: str, pos: Pos) -> KernelError:
        """The error for a name that is not a parameter, an index or a local."""
        params = ", ".join([*self.buffers, *sorted(self.ints)]) or "none"
        return self.error(
            f"{name!r} is not declared: not a parameter (parameters: {params}), a global "
            f"index (gidx0..gidx2, gsz0..gsz2) or a local variable",
            pos,
        )

    def type_of(self, node: Any) -> DType | None:
        """The dtype a declaration's or a cast's type names, if it is one name of the language."""
        if isinstance(node, c_ast.Typename):
            if node.quals:
                return None
            node = node.type
        if (
            not isinstance(node, c_ast.TypeDecl)
            or node.quals
            or not isinstance(node.type, c_ast.IdentifierType)
        ):
            return None
        names = node.type.names
        return ctype.TYPE_NAMES.get(names[0]) if len(names) == 1 else None

    def use_buffer(self, name: str, pos: Pos, *, read: bool) -> None:
        """Record a read or a write of buffer ``name``, checking its declared access."""
        param = self.buffers[name]
        if read and not param.reads:
            raise self.error(f"buffer {name!r} is declared write-only ('w'); declare it 'rw' to read it", pos)
        if not read and not param.writes:
            raise self.error(
                f"buffer {name!r} is declared read-only ('r'); declare it 'w' or 'rw' to write it", pos
            )
        (self.read if read else self.written).add(name)
        self.dtypes_used.add(param.dtype)

    # -- statements
    def items(self, compound: Any) -> tuple[Stmt, ...]:
        """The statements of a ``{ ... }`` block, in the current scope."""
        return tuple(self.statement(s) for s in compound.block_items or ())

    def body_of(self, node: Any) -> tuple[Stmt, ...]:
        """The body of an ``if``, ``else`` or ``for``: a block, or one statement, in its own scope."""
        self.scopes.append({})
        try:
            return self.items(node) if isinstance(node, c_ast.Compound) else (self.statement(node),)
        finally:
            self.scopes.pop()

    def statement(self, node: Any) -> Stmt:
        """One statement of the body."""
        if isinstance(node, c_ast.Compound):
            return Block(self.body_of(node))
        if isinstance(node, c_ast.Decl):
            return self.declaration(node)
        if isinstance(node, c_ast.If):
            cond = self.expression(node.cond)
            then = self.body_of(node.iftrue)
            orelse = () if node.iffalse is None else self.body_of(node.iffalse)
            return If(cond, then, orelse)
        if isinstance(node, c_ast.For):
            return self.for_loop(node)
        if type(node) in _NOT_IN_LANGUAGE:
            raise self.error(
                f"{_NOT_IN_LANGUAGE[type(node)]!r} is not part of the kernel body language", self.at(node)
            )
        if isinstance(node, c_ast.Label):  # "name: ..." reads as a statement about name
            self.target(c_ast.ID(node.name, node.coord))
            offset = self.offset(self.at(node)) + len(node.name)
            found, pos = self.token_after(offset)
            raise self.error(f"expected an assignment to {node.name!r}, found {found}", pos)
        return self.assignment(node)

    def declaration(self, node: Any) -> Decl:
        """``dtype name = value;``: a new local variable."""
        pos = self.at(node)
        if id(node) in self.multi:
            raise self.error("expected ';', found ','", pos)
        words = [*node.storage, *node.funcspec, *node.quals]
        if words or node.align:
            raise self.error(f"{(words or ['_Alignas'])[0]!r} is not part of the kernel body language", pos)
        dtype = self.type_of(node.type)
        if dtype is None:
            found = {c_ast.PtrDecl: "'*'", c_ast.ArrayDecl: "'['", c_ast.FuncDecl: "'('"}.get(type(node.type))
            if found is not None:
                raise self.error(f"expected '=' after {node.name!r}, found {found}", pos)
            raise self.error("a local variable's type must be one dtype name (float32, int, uint8, ...)", pos)
        if node.init is None:
            raise self.error(f"expected '=' after {node.name!r}: a local variable needs a value", pos)
        value = self.expression(node.init)  # before the name is visible, as C scopes it after
        return Decl(dtype, self.declare(dtype, node.name, pos), value)

    def for_loop(self, node: Any) -> For:
        """``for (int k = a; cond; step) body``, the variable declared in the loop's scope."""
        if not isinstance(node.init, c_ast.DeclList):
            raise self.error(
                "a for loop must declare its variable: for (int k = 0; k < n; k++)",
                self.at(node if node.init is None else node.init),
            )
        self.scopes.append({})
        try:
            init = self.declaration(node.init.decls[0])
            if len(node.init.decls) > 1:
                raise self.error("expected ';', found ','", self.at(node.init.decls[1]))
            if not init.dtype.is_int:
                raise self.error("a for loop variable must have an integer type", self.at(node.init.decls[0]))
            if node.cond is None:
                raise self.error("expected an expression, found ';'", self.at(node))
            cond = self.expression(node.cond)
            if node.next is None:
                raise self.error("expected a statement, found ')'", self.at(node))
            step = self.assignment(node.next)
            if not isinstance(step, Assign) or step.name != init.name:
                raise self.error(
                    f"the step of a for loop must update its variable {init.name!r}", self.at(node.next)
                )
            body = self.body_of(node.stmt)
        finally:
            self.scopes.pop()
        return For(init, cond, step, body)

    def target(self, node: Any) -> tuple[str, Expr | None, DType, Pos]:
        """Check the target of an assignment: a local, or an indexed buffer; returns its name,
        index, dtype and position."""
        where = self.paren(node)
        if where is not None:
            raise self.error("expected a statement, found '('", where)
        index_node = None
        if isinstance(node, c_ast.ArrayRef):
            index_node, node = node.subscript, node.name
            where = self.paren(node)
            if where is not None:
                raise self.error("expected a statement, found '('", where)
        if not isinstance(node, c_ast.ID):
            found = node.value if isinstance(node, c_ast.Constant) else getattr(node, "op", "(")[-2:]
            if isinstance(node, (c_ast.ArrayRef, c_ast.FuncCall)) and isinstance(node.name, c_ast.ID):
                found = node.name.name
            raise self.error(f"expected a statement, found {found!r}", self.at(node))
        name, pos = node.name, self.at(node)
        if name in self.buffers:
            if index_node is None:
                raise self.error(f"buffer {name!r} must be indexed: {name}[i]", pos)
            return name, self.index_expr(index_node), self.buffers[name].dtype, pos
        local = self.lookup_local(name)
        if local is None:
            if name in self.ints or name in GLOBAL_NAMES:
                raise self.error(f"{name!r} is read-only", pos)
            if name in FUNCTIONS:
                raise self.error(f"expected a statement, found {name!r}", pos)
            raise self.undeclared(name, pos)
        if index_node is not None:
            raise self.error(f"expected an assignment to {name!r}, found '['", pos)
        return name, None, local, pos

    def assignment(self, node: Any) -> Store | Assign:
        """An assignment statement (or a for loop's step): ``t = e``, ``t op= e``, ``t++``..."""
        if isinstance(node, c_ast.UnaryOp) and node.op in ("++", "--", "p++", "p--"):
            target, op, value_node = node.expr, node.op[-2:], None
        elif isinstance(node, c_ast.Assignment):
            target, op, value_node = node.lvalue, node.op, node.rvalue
        elif isinstance(node, c_ast.ExprList):
            self.assignment(node.exprs[0])
            raise self.error("expected ';', found ','", self.before(",", node.exprs[1]))
        else:  # an expression that assigns nothing: its first name is checked as a target
            first = node
            while isinstance(first, (c_ast.BinaryOp, c_ast.TernaryOp)) and self.paren(first) is None:
                first = first.left if isinstance(first, c_ast.BinaryOp) else first.cond
            name, index, _, pos = self.target(first)
            offset = self.offset(pos) + len(name)
            if index is not None:
                offset = self.after_brackets(offset)
            found, pos = self.token_after(offset)
            raise self.error(f"expected an assignment to {name!r}, found {found}", pos)
        name, index, dtype, pos = self.target(target)
        if index is not None:
            current = Expr("load", ctype.promote(dtype), name, (index,))
        else:
            current = Expr("var", dtype, name)
        if op in ("++", "--"):
            value = self.binary(op[0], current, Expr("const", dtypes.int32, "1"), pos)
        elif op == "=":
            value = self.expression(value_node)
        else:
            value = self.binary(op[:-1], current, self.expression(value_node), pos)
        if op != "=" and index is not None:
            self.use_buffer(name, pos, read=True)
        if index is not None:
            self.use_buffer(name, pos, read=False)
            return Store(name, index, value)
        return Assign(name, value)

    # -- expressions
    def expression(self, node: Any) -> Expr:
        """A typed expression; anything outside the language raises KernelError."""
        pos = self.at(node)
        if isinstance(node, c_ast.Constant):
            return self.constant(node, pos)
        if isinstance(node, c_ast.ID):
            return self.name(node.name, pos)
        if isinstance(node, c_ast.ArrayRef):
            base = node.name
            if isinstance(base, c_ast.ID) and self.paren(base) is None and base.name in self.buffers:
                index = self.index_expr(node.subscript)
                self.use_buffer(base.name, pos, read=True)
                return Expr("load", ctype.promote(self.buffers[base.name].dtype), base.name, (index,))
            self.expression(base)  # the old language reads the base first, then stops at '['
            raise self.error("only a buffer can be indexed: buf[i]", pos)
        if isinstance(node, c_ast.FuncCall):
            if isinstance(node.name, c_ast.ID) and self.paren(node.name) is None:
                if node.name.name in self.buffers:
                    raise self.error(f"buffer {node.name.name!r} must be indexed: {node.name.name}[i]", pos)
                args = [] if node.args is None else node.args.exprs
                return self.call(node.name.name, args, pos)
            self.expression(node.name)
            raise self.error("only a math function can be called", pos)
        if isinstance(node, c_ast.UnaryOp):
            return self.unary(node, self.position(self.start(node)))
        if isinstance(node, c_ast.BinaryOp):
            a, b = self.expression(node.left), self.expression(node.right)
            return self.binary(node.op, a, b, self.before(node.op, node.right))
        if isinstance(node, c_ast.TernaryOp):
            cond, then, orelse = (self.expression(n) for n in (node.cond, node.iftrue, node.iffalse))
            both_bool = then.dtype == orelse.dtype == dtypes.bool
            dtype = dtypes.bool if both_bool else ctype.arith(then.dtype, orelse.dtype)
            return Expr("ternary", dtype, "?", (cond, then, orelse))
        if isinstance(node, c_ast.Cast):
            cast_to = self.type_of(node.to_type)
            if cast_to is None:
                raise self.error("a cast must name one dtype: (float32)x, (int64)x", pos)
            if cast_to in ctype.STORAGE_ONLY:
                raise self.error(f"cannot cast to {cast_to.name}, a storage type: store it to a buffer", pos)
            self.dtypes_used.add(cast_to)
            return Expr("cast", cast_to, "", (self.expression(node.expr),))
        if isinstance(node, c_ast.Assignment):
            raise self.error(f"{node.op!r} is a statement, not an expression", pos)
        if isinstance(node, c_ast.ExprList):
            raise self.error("the comma operator is not part of the kernel body language", pos)
        what = {
            c_ast.StructRef: "a struct member",
            c_ast.Compound: "a statement expression",
            c_ast.CompoundLiteral: "a compound literal",
        }
        raise self.error(
            f"{what.get(type(node), 'this expression')} is not part of the kernel body language", pos
        )

    def constant(self, node: Any, pos: Pos) -> Expr:
        """An integer or float literal, typed as C types it."""
        text = node.value
        if node.type in ("float", "double", "long double"):
            if not _FLOAT_TEXT.match(text):
                raise self.error(
                    f"float literal {text} is malformed: write 1.5f (float32) or 1.5 (float64)", pos
                )
            dtype = dtypes.float32 if text[-1] in "fF" else dtypes.float64
        else:
            found = ctype.int_literal_dtype(text) if _INT_TEXT.match(text) else None
            if found is None:
                raise self.error(f"integer literal {text} is malformed or does not fit in 64 bits", pos)
            dtype = found
        self.dtypes_used.add(dtype)
        return Expr("const", dtype, text)

    def name(self, name: str, pos: Pos) -> Expr:
        """A name used as a value: true/false, an int parameter, a global index or a local."""
        if name in ("true", "false"):
            return Expr("const", dtypes.bool, name)
        if name in self.buffers:
            raise self.error(f"buffer {name!r} must be indexed: {name}[i]", pos)
        if name in self.ints or name in GLOBAL_NAMES:
            return Expr("var", dtypes.int32, name)
        local = self.lookup_local(name)
        if local is not None:
            return Expr("var", local, name)
        raise self.undeclared(name, pos)

    def unary(self, node: Any, pos: Pos) -> Expr:
        """``-x``, ``+x``, ``!x`` or ``~x``."""
        op = node.op
        if op in ("++", "--", "p++", "p--"):
            raise self.error(f"{op[-2:]!r} is a statement, not an expression", pos)
        if op not in ("-", "+", "!", "~"):
            found = op if op in ("&", "*") else None
            if found is not None:
                raise self.error(f"expected an expression, found {found!r}", pos)
            raise self.error(f"{op!r} is not part of the kernel body language", pos)
        x = self.expression(node.expr)
        if op == "~" and x.dtype.is_float:
            raise self.error(f"operator '~' needs an integer operand, got {x.dtype.name}", pos)
        dtype = dtypes.bool if op == "!" else ctype.promote(x.dtype)
        return Expr("unary", dtype, op, (x,))

    def binary(self, op: str, a: Expr, b: Expr, pos: Pos) -> Expr:
        """A binary operation, typed by C's rules; integer-only operators check their operands."""
        if op in ctype.INT_ONLY_OPS and (a.dtype.is_float or b.dtype.is_float):
            raise self.error(
                f"operator {op!r} needs integer operands, got {a.dtype.name} and {b.dtype.name}", pos
            )
        if op in ctype.BOOL_RESULT_OPS:
            dtype = dtypes.bool
        elif op in ("<<", ">>"):
            dtype = ctype.promote(a.dtype)
        else:
            dtype = ctype.arith(a.dtype, b.dtype)
        self.dtypes_used.add(dtype)
        return Expr("binary", dtype, op, (a, b))

    def index_expr(self, node: Any) -> Expr:
        """A buffer index: an integer (or bool) expression."""
        index = self.expression(node)
        if not index.dtype.is_int and index.dtype != dtypes.bool:
            raise self.error(f"an index must be an integer, got {index.dtype.name}", self.at(node))
        return index

    def call(self, name: str, arg_nodes: Sequence[Any], pos: Pos) -> Expr:
        """A call of one of the language's math functions, checked for arity and argument types."""
        if name not in FUNCTIONS:
            if name in self.buffers or name in self.ints or name in GLOBAL_NAMES or self.lookup_local(name):
                raise self.error(f"{name!r} is not a function", pos)
            known = ", ".join(sorted(FUNCTIONS))
            raise self.error(f"unknown function {name!r}; known functions: {known}", pos)
        args = [self.expression(a) for a in arg_nodes]
        arity = 1 if name in UNARY_FLOAT_FUNCS else 2 if name in BINARY_FLOAT_FUNCS else GENERIC_FUNCS[name]
        if len(args) != arity:
            raise self.error(
                f"{name}() takes {arity} argument{'s' if arity > 1 else ''}, got {len(args)}", pos
            )
        if name in GENERIC_FUNCS:
            dtype = ctype.promote(args[0].dtype) if arity == 1 else ctype.arith(args[0].dtype, args[1].dtype)
            self.dtypes_used.add(dtype)
            return Expr("call", dtype, name, tuple(args))
        for arg in args:
            if not arg.dtype.is_float:
                raise self.error(
                    f"{name}() needs float arguments, got {arg.dtype.name}; cast it: {name}((float32)x)", pos
                )
        dtype = ctype.arith(args[0].dtype, args[-1].dtype)
        self.functions_used.add((name, dtype))
        return Expr("call", dtype, name, tuple(args))
