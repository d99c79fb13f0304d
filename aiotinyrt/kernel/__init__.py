"""Portable kernels: a kernel description, its body language, and C-style source for each backend.

The package: ``params`` (parameters, reserved names, :class:`KernelError`), ``tree`` (the typed
body), ``ctype`` (C's typing rules), ``parser`` and ``walk`` (the body read by pycparser and
checked), ``spec`` (:class:`Kernel`), ``render_c``, ``render_cl`` and ``render_cuda``.

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

from aiotinyrt.kernel.params import FUNCTIONS, RESERVED_NAMES, BufferParam, IntParam, KernelError, Param
from aiotinyrt.kernel.render_c import ClangRenderer, CStyleRenderer, Renderer
from aiotinyrt.kernel.render_cl import OpenCLRenderer
from aiotinyrt.kernel.render_cuda import CUDARenderer
from aiotinyrt.kernel.spec import Kernel, cpu_threads
from aiotinyrt.kernel.tree import Assign, Block, Decl, Expr, For, If, Stmt, Store

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
    "RENDERERS",
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
    "Stmt",
    "Store",
    "cpu_threads",
    "render",
]
