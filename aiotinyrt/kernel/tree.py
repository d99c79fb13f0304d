"""The checked, typed body of a kernel: what the parser produces and the renderers print."""

from __future__ import annotations

from dataclasses import dataclass

from aiotinyrt.dtype import DType


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
