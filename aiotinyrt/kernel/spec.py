"""The portable kernel: :class:`Kernel` (a name, typed parameters and a checked body) and the
CPU's thread count for a launch (:func:`cpu_threads`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from aiotinyrt.dtype import DType
from aiotinyrt.kernel.params import BufferParam, IntParam, KernelError, Param, check_name
from aiotinyrt.kernel.parser import parse_body
from aiotinyrt.kernel.tree import Stmt


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
    """A portable kernel: a name, typed parameters and a body (see :mod:`aiotinyrt.kernel`).

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
        self.name = check_name("kernel name", name)
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
        parsed = parse_body(name, body, self.params)
        #: The checked, typed body.
        self.statements: tuple[Stmt, ...] = parsed.statements
        #: Names of the buffers the body actually reads and writes.
        self.read: frozenset[str] = parsed.read
        self.written: frozenset[str] = parsed.written
        self.dtypes_used: frozenset[DType] = parsed.dtypes_used | {b.dtype for b in self.buffers}
        self.functions_used: frozenset[tuple[str, DType]] = parsed.functions_used

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
