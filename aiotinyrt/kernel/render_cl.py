"""OpenCL C: one work item per global index, ``__kernel void name(<buffers>, <ints>, gsz0, gsz1,
gsz2)``."""

from __future__ import annotations

from typing import ClassVar

from aiotinyrt.dtype import DType, dtypes
from aiotinyrt.kernel.params import BufferParam
from aiotinyrt.kernel.render_c import BF16_DOC, CStyleRenderer
from aiotinyrt.kernel.spec import Kernel


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
    bf16_helpers: ClassVar[str] = f"""{BF16_DOC}
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
