"""C's typing rules for the body language: integer promotion, the usual arithmetic conversions
and the type of an integer literal."""

from __future__ import annotations

from aiotinyrt.dtype import DType, dtypes

INT_RANK = {
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
TO_UNSIGNED = {dtypes.int32: dtypes.uint32, dtypes.int64: dtypes.uint64}
STORAGE_ONLY = (dtypes.float16, dtypes.bfloat16)


def promote(dt: DType) -> DType:
    """C's integer promotion; 16-bit floats compute as float32."""
    if dt in STORAGE_ONLY:
        return dtypes.float32
    if not dt.is_float and INT_RANK[dt] < 3:
        return dtypes.int32
    return dt


def arith(a: DType, b: DType) -> DType:
    """C's usual arithmetic conversions."""
    a, b = promote(a), promote(b)
    if dtypes.float64 in (a, b):
        return dtypes.float64
    if dtypes.float32 in (a, b):
        return dtypes.float32
    if a == b:
        return a
    if a.is_unsigned == b.is_unsigned:
        return a if INT_RANK[a] > INT_RANK[b] else b
    unsigned, signed = (a, b) if a.is_unsigned else (b, a)
    if INT_RANK[unsigned] >= INT_RANK[signed]:
        return unsigned
    if INT_RANK[signed] > INT_RANK[unsigned]:
        return signed
    return TO_UNSIGNED[signed]


ASSIGN_OPS = ("=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>=")
INT_ONLY_OPS = frozenset(("%", "&", "|", "^", "<<", ">>", "~"))
BOOL_RESULT_OPS = frozenset(("||", "&&", "==", "!=", "<", "<=", ">", ">=", "!"))


def int_literal_dtype(text: str) -> DType | None:
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


#: Every type name of the language (dtype names and aliases) and its dtype.
TYPE_NAMES: dict[str, DType] = {
    n: getattr(dtypes, n) for n in dir(dtypes) if isinstance(getattr(dtypes, n), DType)
}
