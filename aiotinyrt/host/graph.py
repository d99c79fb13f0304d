"""The host graph builder: a run of captured host-code launches compiled into one C function.

The function calls each kernel through an address it is given in an array (each program's
``_addr``), with the arguments recorded at capture from a second array, so it links against
none of the kernels' symbols and its code is cacheable; a transfer folded into the run is a
``memmove`` resolved from libc.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from aiotinyrt.device import Compiled
from aiotinyrt.graph import NativeRun
from aiotinyrt.host.memory import ffi


async def compile_run(
    device: Compiled, entries: Sequence[Any], program: type[Any], transfer: Callable[..., object]
) -> NativeRun | None:
    """``entries`` (a run of :class:`~aiotinyrt.graph.Graph`'s captured commands) as one C
    function, or None when one of them is not a call it can make: every entry must be on the
    device's compute queue and be a raw launch of a ``program`` (a class with ``function(nbufs,
    nvals)`` and ``_addr``, constructed as ``program(device, name, binary)``) or the allocator's
    ``transfer`` (the plain function ``memmove(dest.addr, src.addr, nbytes)`` implements)."""

    def is_transfer(fn: Any) -> bool:
        return getattr(fn, "__func__", None) is transfer

    if not all(
        e.queue is device._compute_queue
        and (
            is_transfer(e.fn)  # a transfer folded into the run (see Graph._fold_transfers)
            or (
                isinstance(e.program, program)
                and e.fn is e.program.function(len(e.bufs), len(e.args) - len(e.bufs))
            )
        )
        for e in entries
    ):
        return None
    lines: list[str] = []
    flat: list[int] = []
    positions: dict[tuple[int, int], list[int]] = {}
    starts: list[int] = []
    for i, entry in enumerate(entries):
        starts.append(len(flat))
        if is_transfer(entry.fn):  # memmove(dest, src, nbytes): views of one buffer may overlap
            base = len(flat)
            dest, src, nbytes, _ = entry.args
            flat.extend((dest.addr, src.addr, nbytes))
            for b, slots in enumerate(entry.slots):
                positions[(i, b)] = [base + j for j, _ in slots]
            d, s_, n = base, base + 1, base + 2
            lines.append(f"  memmove((void *)a[{d}], (const void *)a[{s_}], (size_t)a[{n}]);")
            continue
        nbufs = len(entry.bufs)
        params = ", ".join(["uintptr_t"] * nbufs + ["int32_t"] * (len(entry.args) - nbufs)) or "void"
        base = len(flat)
        call = [f"a[{base + j}]" if j < nbufs else f"(int32_t)a[{base + j}]" for j in range(len(entry.args))]
        flat.extend(
            a & 0xFFFF_FFFF_FFFF_FFFF if isinstance(a, int) else int(ffi.cast("uintptr_t", a))
            for a in entry.args
        )
        for b, slots in enumerate(entry.slots):
            positions[(i, b)] = [base + j for j, _ in slots]
        lines.append(f"  ((void (*)({params}))f[{i}])({', '.join(call)});")
    src = (
        "#include <stdint.h>\n#include <string.h>\n"
        "void graph_replay(const uintptr_t *restrict f, const uintptr_t *restrict a) {\n"
        + "\n".join(lines)
        + "\n}\n"
    )
    replay = program(device, "graph_replay", await device.compiler.compile_cached(src))
    count = max(len(flat), 1)

    def copy_args(old: Any) -> Any:
        new = ffi.new("uintptr_t[]", count)
        ffi.memmove(new, old, count * 8)
        return new

    return NativeRun(
        cfunc=ffi.cast("void (*)(uintptr_t *, uintptr_t *)", replay._addr),
        fns=ffi.new(
            "uintptr_t[]",
            [0 if is_transfer(e.fn) else int(ffi.cast("uintptr_t", e.program._addr)) for e in entries],
        ),
        args=ffi.new("uintptr_t[]", flat or [0]),
        positions=positions,
        copy_args=copy_args,
        keep=(replay, [e.program for e in entries if e.program is not None]),
        starts=starts,
    )
