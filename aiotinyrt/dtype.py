"""Data types: the scalar types buffers and kernels use, with their C names and sizes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, eq=True)
class DType:
    """A scalar data type.

    ``fmt`` is the ``struct``/``memoryview`` format character (None where Python has none,
    e.g. bfloat16, which is storage only); ``cname`` is the type's spelling in C kernels.
    """

    name: str
    itemsize: int
    fmt: str | None
    cname: str
    kind: str  # "bool", "int", "uint" or "float"

    def __repr__(self) -> str:
        return f"dtypes.{self.name}"

    @property
    def is_float(self) -> bool:
        return self.kind == "float"

    @property
    def is_int(self) -> bool:
        return self.kind in ("int", "uint")

    @property
    def is_unsigned(self) -> bool:
        return self.kind == "uint"


class dtypes:
    """The dtypes namespace, as in tinygrad (``dtypes.float32``, ``dtypes.int``...)."""

    bool: ClassVar[DType] = DType("bool", 1, "?", "bool", "bool")
    int8: ClassVar[DType] = DType("int8", 1, "b", "signed char", "int")
    uint8: ClassVar[DType] = DType("uint8", 1, "B", "unsigned char", "uint")
    int16: ClassVar[DType] = DType("int16", 2, "h", "short", "int")
    uint16: ClassVar[DType] = DType("uint16", 2, "H", "unsigned short", "uint")
    int32: ClassVar[DType] = DType("int32", 4, "i", "int", "int")
    uint32: ClassVar[DType] = DType("uint32", 4, "I", "unsigned int", "uint")
    int64: ClassVar[DType] = DType("int64", 8, "q", "long long", "int")
    uint64: ClassVar[DType] = DType("uint64", 8, "Q", "unsigned long long", "uint")
    float16: ClassVar[DType] = DType("float16", 2, "e", "__fp16", "float")
    bfloat16: ClassVar[DType] = DType("bfloat16", 2, None, "__bf16", "float")
    float32: ClassVar[DType] = DType("float32", 4, "f", "float", "float")
    float64: ClassVar[DType] = DType("float64", 8, "d", "double", "float")

    # tinygrad-style aliases
    char = int8
    uchar = uint8
    short = int16
    ushort = uint16
    int = int32
    uint = uint32
    long = int64
    ulong = uint64
    half = float16
    float = float32
    double = float64

    @staticmethod
    def all() -> tuple[DType, ...]:
        """Every distinct dtype, smallest first."""
        return ALL_DTYPES

    @staticmethod
    def from_name(name: str) -> DType:
        """Look a dtype up by name or alias (``"float32"``, ``"float"``, ``"half"``)."""
        found = getattr(dtypes, name, None)
        if not isinstance(found, DType):
            known = ", ".join(d.name for d in ALL_DTYPES)
            raise ValueError(f"unknown dtype {name!r}; known dtypes: {known}")
        return found


ALL_DTYPES: tuple[DType, ...] = (
    dtypes.bool,
    dtypes.int8,
    dtypes.uint8,
    dtypes.int16,
    dtypes.uint16,
    dtypes.int32,
    dtypes.uint32,
    dtypes.int64,
    dtypes.uint64,
    dtypes.float16,
    dtypes.bfloat16,
    dtypes.float32,
    dtypes.float64,
)
