"""Names and parameters of a portable kernel: :class:`BufferParam`, :class:`IntParam`, the
reserved words and the math functions of the body language, and :class:`KernelError`."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from aiotinyrt.dtype import ALL_DTYPES, DType, dtypes


class KernelError(ValueError):
    """A :class:`~aiotinyrt.kernel.Kernel` is malformed: bad name, dtype or parameter, or a body
    that does not check. Raised when the kernel is built, before anything is compiled."""


IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: Words a kernel, parameter or local variable may not be called: keywords and reserved words of
#: C (C11 included: the body is read by a C parser), OpenCL C and CUDA C++, the body language's
#: type names, and the names of the convention.
RESERVED_NAMES: frozenset[str] = frozenset(
    " ".join(
        (
            "auto break case char const continue default do double else enum extern float for goto if",
            "inline int long register restrict return short signed sizeof static struct switch typedef",
            "union unsigned void volatile while _Bool _Complex _Imaginary bool true false",
            "_Alignas _Alignof _Atomic _Noreturn _Pragma _Static_assert _Thread_local offsetof",
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

#: The read-only ints every body sees: the global index and the global size.
GLOBAL_NAMES = ("gidx0", "gidx1", "gidx2", "gsz0", "gsz1", "gsz2")

UNARY_FLOAT_FUNCS = frozenset(
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
BINARY_FLOAT_FUNCS = frozenset(("pow", "fmin", "fmax"))
#: min, max and abs work on any arithmetic type (rendered as conditional expressions)
GENERIC_FUNCS = {"min": 2, "max": 2, "abs": 1}
#: Every function a body may call.
FUNCTIONS: frozenset[str] = UNARY_FLOAT_FUNCS | BINARY_FLOAT_FUNCS | frozenset(GENERIC_FUNCS)


def check_name(what: str, name: object) -> str:
    """``name`` if it may name a kernel or a parameter, else :class:`KernelError`."""
    if not isinstance(name, str):
        raise KernelError(f"{what} must be a str, got {type(name).__name__}")
    if not IDENTIFIER.match(name):
        raise KernelError(f"{what} {name!r} is not a C identifier (letters, digits and _, not first a digit)")
    if name in RESERVED_NAMES or name.startswith(("__", "aiotinyrt_")):
        raise KernelError(
            f"{what} {name!r} is reserved (a keyword of C, OpenCL or CUDA, or of the convention)"
        )
    if name in FUNCTIONS or name.removesuffix("f") in FUNCTIONS:
        raise KernelError(f"{what} {name!r} is the name of a math function")
    return name


def check_dtype(what: str, dtype: object) -> DType:
    """``dtype`` (a DType or a dtype name) as one of the known dtypes, else :class:`KernelError`."""
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


Access = Literal["r", "w", "rw"]


@dataclass(frozen=True)
class BufferParam:
    """A buffer parameter: a pointer to elements of ``dtype``; ``access`` is ``"r"`` (default),
    ``"w"`` or ``"rw"``."""

    name: str
    dtype: DType
    access: Access = "r"

    def __post_init__(self) -> None:
        check_name("buffer parameter name", self.name)
        object.__setattr__(self, "dtype", check_dtype(f"buffer {self.name!r}", self.dtype))
        if self.access not in ("r", "w", "rw"):
            raise KernelError(f"buffer {self.name!r}: access must be 'r', 'w' or 'rw', got {self.access!r}")

    @property
    def reads(self) -> bool:
        """Whether the kernel may read the buffer (``"r"`` or ``"rw"``)."""
        return "r" in self.access

    @property
    def writes(self) -> bool:
        """Whether the kernel may write the buffer (``"w"`` or ``"rw"``)."""
        return "w" in self.access


@dataclass(frozen=True)
class IntParam:
    """A 32-bit signed int parameter (passed in a launch's ``vals``)."""

    name: str

    def __post_init__(self) -> None:
        check_name("int parameter name", self.name)

    @property
    def dtype(self) -> DType:
        """Always ``int32``."""
        return dtypes.int32


Param = BufferParam | IntParam
