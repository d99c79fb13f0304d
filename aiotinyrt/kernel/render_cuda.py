"""CUDA C++: ``extern "C" __global__`` kernels for NVRTC or nvcc, one thread per global index."""

from __future__ import annotations

from typing import ClassVar

from aiotinyrt.dtype import DType, dtypes
from aiotinyrt.kernel.params import BufferParam
from aiotinyrt.kernel.render_c import BF16_DOC, C_TYPE_NAMES, CStyleRenderer
from aiotinyrt.kernel.spec import Kernel


class CUDARenderer(CStyleRenderer):
    """CUDA C++ (``extern "C"`` kernels, for NVRTC or nvcc). One thread per global index;
    threads outside the global size return at once."""

    device: ClassVar[str] = "CUDA"
    has_local: ClassVar[bool] = True
    type_names: ClassVar[dict[DType, str]] = C_TYPE_NAMES
    storage_names: ClassVar[dict[DType, str]] = {dtypes.float16: "half", dtypes.bfloat16: "unsigned short"}
    true_false: ClassVar[tuple[str, str]] = ("true", "false")
    bf16_helpers: ClassVar[str] = f"""{BF16_DOC}
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
