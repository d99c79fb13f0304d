"""The C-style printer shared by every renderer, and :class:`ClangRenderer`, C for the CPU.

The printer turns the typed tree of :mod:`aiotinyrt.kernel.tree` into C-like statements; a
backend's renderer names its types, its math functions, its 16-bit float loads and stores, and
the kernel's prologue. The CPU kernel loops over the global size itself and takes ``core_id,
core_count`` to run one chunk of it (the convention is in :mod:`aiotinyrt.kernel`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from aiotinyrt.dtype import ALL_DTYPES, DType, dtypes
from aiotinyrt.kernel.params import GENERIC_FUNCS, BufferParam
from aiotinyrt.kernel.spec import Kernel
from aiotinyrt.kernel.tree import Assign, Decl, Expr, For, If, Stmt, Store

INDENT = "  "


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
            if e.arg in GENERIC_FUNCS:
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
        pad = INDENT * depth
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


BF16_DOC = "/* bfloat16 is stored as uint16: the top half of a float32, rounded to nearest even */"


# C and CUDA spell the arithmetic types the same way (DType.cname); f16/bf16 are storage types
C_TYPE_NAMES: dict[DType, str] = {
    dt: dt.cname for dt in ALL_DTYPES if dt not in (dtypes.float16, dtypes.bfloat16)
}


class ClangRenderer(CStyleRenderer):
    """C for the CPU backend (clang or gcc). The kernel loops over the global size and takes
    ``core_id, core_count`` to split it across threads (see :mod:`aiotinyrt.kernel`)."""

    device: ClassVar[str] = "CPU"
    has_local: ClassVar[bool] = False
    type_names: ClassVar[dict[DType, str]] = {**C_TYPE_NAMES, dtypes.bool: "_Bool"}
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
    bf16_helpers: ClassVar[str] = f"""{BF16_DOC}
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
            lines.append(f"{INDENT * depth}for ({loop}) {{")
        lines.append(body)
        lines += [f"{INDENT * depth}}}" for depth in (3, 2, 1)]
        lines.append("}")
        return "\n".join(lines) + "\n"
