"""AArch64 objects linked by aiotinyrt.host.elf, executed under qemu-user and compared with x86-64.

The x86-64 half of the ELF loader runs in tests/test_elf.py; this file runs the AArch64 half. A
small static AArch64 program (:data:`HARNESS`, built here by Debian's AArch64 cross gcc against
its arm64 libc) reserves address space, prints where it is and the addresses of its
own libm/libc functions, then takes commands on stdin: place bytes that ``elf.link`` produced
for an address (code is written, then protected read+execute and the instruction cache
flushed, as the runtime does), copy in buffers, call an entry point with pointer and integer
arguments, write the buffers back. Each kernel is compiled from the same source for AArch64
with the CPU compiler's flags (``-march=native`` left out), by clang and by gcc, and run in the
harness, and by the CPU device on this machine; the outputs must agree (floats to a tolerance: the two libms
may round differently). The code and data blocks lie 0x12345000 + 0x5a0 bytes apart, so every
ADRP that reaches data spans many pages.
"""

from __future__ import annotations

import platform
import resource
import shutil
import struct
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiotinyrt import Buffer, Device, dtypes
from aiotinyrt.backends.ops_cpu import ClangCompiler
from aiotinyrt.dtype import DType
from aiotinyrt.host import elf
from aiotinyrt.kernel import BufferParam, ClangRenderer, IntParam, Kernel

pytestmark = [pytest.mark.anyio, pytest.mark.slow, pytest.mark.usefixtures("cpu_buffers")]

#: The CPU compiler's flags for the AArch64 object; -march=native names this (x86-64) machine.
OBJECT_FLAGS = [f for f in ClangCompiler.FLAGS if f != "-march=native"]
GAP = 0x1234_5000  # code block at the reservation's start, data block this far on (+ DATA_SKEW)
DATA_SKEW = 0x5A0  # the data block is 16-aligned, not page-aligned, as in the runtime's arenas
SPAN = GAP + (64 << 20)  # bytes the harness reserves

HARNESS = r"""
#define _GNU_SOURCE
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef uint64_t u64;
typedef void (*entry_fn)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64,
                         u64);

#define FN(f) {#f, (u64)(uintptr_t)&f}
static const struct { const char *name; u64 addr; } exported[] = {
  FN(expf), FN(exp2f), FN(logf), FN(log2f), FN(sinf), FN(cosf), FN(tanf), FN(tanhf), FN(powf),
  FN(sqrtf), FN(floorf), FN(ceilf), FN(truncf), FN(roundf), FN(fmaf), FN(fminf), FN(fmaxf),
  FN(exp), FN(exp2), FN(log), FN(log2), FN(sin), FN(cos), FN(tan), FN(tanh), FN(pow), FN(sqrt),
  FN(floor), FN(ceil), FN(trunc), FN(round), FN(fma), FN(fmin), FN(fmax),
  FN(memcpy), FN(memmove), FN(memset),
};

#define MAX_BUFS 16
static unsigned char *bufs[MAX_BUFS];
static u64 sizes[MAX_BUFS];
static unsigned nbufs;

static void die(const char *what) {
  fprintf(stderr, "harness: %s\n", what);
  exit(2);
}

static void read_all(void *to, u64 n) {
  unsigned char *p = to;
  while (n) {
    ssize_t got = read(0, p, n);
    if (got <= 0) die("short read on stdin");
    p += got;
    n -= (u64)got;
  }
}

static void write_all(const void *from, u64 n) {
  const unsigned char *p = from;
  while (n) {
    ssize_t put = write(1, p, n);
    if (put <= 0) die("short write on stdout");
    p += put;
    n -= (u64)put;
  }
}

static u64 next(void) {
  u64 v;
  read_all(&v, sizeof v);
  return v;
}

int main(int argc, char **argv) {
  if (argc != 2) die("usage: harness SPAN");
  u64 span = strtoull(argv[1], NULL, 0), page = (u64)sysconf(_SC_PAGESIZE);
  unsigned char *base = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (base == MAP_FAILED) die("cannot reserve the address space");
  printf("base %#llx\n", (unsigned long long)(uintptr_t)base);
  for (unsigned i = 0; i < sizeof exported / sizeof exported[0]; i++)
    printf("%s %#llx\n", exported[i].name, (unsigned long long)exported[i].addr);
  printf("end\n");
  fflush(stdout);
  for (;;) {
    u64 op = next();
    if (op == 'P') { /* place: address, size, executable?, bytes */
      u64 addr = next(), size = next(), exec = next();
      u64 lo = addr & ~(page - 1), hi = (addr + size + page - 1) & ~(page - 1);
      if (lo < (u64)(uintptr_t)base || hi > (u64)(uintptr_t)base + span) die("place outside the reservation");
      void *at = (void *)(uintptr_t)lo;
      if (mmap(at, hi - lo, PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0) != at)
        die("mmap MAP_FIXED failed");
      read_all((void *)(uintptr_t)addr, size);
      if (exec) {
        if (mprotect(at, hi - lo, PROT_READ | PROT_EXEC) != 0) die("mprotect read+exec failed");
        __builtin___clear_cache((char *)(uintptr_t)addr, (char *)(uintptr_t)(addr + size));
      }
    } else if (op == 'B') { /* buffer: size, bytes */
      if (nbufs == MAX_BUFS) die("too many buffers");
      u64 size = next();
      bufs[nbufs] = aligned_alloc(64, (size + 63) & ~(u64)63);
      if (!bufs[nbufs]) die("out of memory");
      read_all(bufs[nbufs], size);
      sizes[nbufs++] = size;
    } else if (op == 'C') { /* call: entry, count, then (is buffer, value) per argument */
      u64 entry = next(), count = next(), args[16] = {0};
      if (count > 16) die("too many arguments");
      for (u64 i = 0; i < count; i++) {
        u64 is_buffer = next(), value = next();
        if (is_buffer && value >= nbufs) die("no such buffer");
        args[i] = is_buffer ? (u64)(uintptr_t)bufs[value] : value;
      }
      entry_fn fn = (entry_fn)(uintptr_t)entry;
      fn(args[0], args[1], args[2], args[3], args[4], args[5], args[6], args[7], args[8], args[9],
         args[10], args[11], args[12], args[13], args[14], args[15]);
    } else if (op == 'E') { /* end: every buffer back */
      for (unsigned i = 0; i < nbufs; i++) write_all(bufs[i], sizes[i]);
      return 0;
    } else {
      die("unknown command");
    }
  }
}
"""


CROSS_GCC = "aarch64-linux-gnu-gcc"
#: The compilers of the objects: the runtime's two (it prefers clang).
COMPILERS = {"clang": ["clang", "--target=aarch64-linux-gnu"], "gcc": [CROSS_GCC]}


def _missing_package() -> str | None:
    """The Debian package (and what of it) this machine lacks for the harness; None: nothing."""
    for tool, package in {CROSS_GCC: "gcc-aarch64-linux-gnu", "qemu-aarch64": "qemu-user"}.items():
        if shutil.which(tool) is None:
            return f"{package} ({tool})"
    if not Path("/usr/aarch64-linux-gnu/lib/libc.a").exists():
        return "libc6-dev-arm64-cross (/usr/aarch64-linux-gnu/lib/libc.a)"
    return None


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The harness, cross-compiled and statically linked (the addresses it prints are taken
    while it runs, so they hold whether or not the binary is position-independent)."""
    if elf.host_machine() != elf.EM_X86_64:  # an AArch64 host runs its objects in tests/test_elf.py
        pytest.skip(f"runs AArch64 code under qemu-user on x86-64 hosts; this is {platform.machine()}")
    missing = _missing_package()
    if missing is not None:
        pytest.skip(f"needs {missing}; .ci/run installs it")
    folder = tmp_path_factory.mktemp("aarch64")
    (folder / "harness.c").write_text(HARNESS)
    argv = [CROSS_GCC, "-static", "-O1", "-Wall", "-Wextra", "-Werror", "harness.c", "-o", "harness", "-lm"]
    subprocess.run(argv, cwd=folder, check=True)
    return folder / "harness"


@pytest.fixture(params=sorted(COMPILERS))
def compiler(request: pytest.FixtureRequest, harness: Path) -> list[str]:
    """The command line that compiles a kernel for AArch64 (the CPU compiler's flags follow)."""
    argv = COMPILERS[request.param]
    if shutil.which(argv[0]) is None:
        pytest.skip(f"needs {argv[0]}; .ci/run installs it")
    return argv


@dataclass(frozen=True)
class Call:
    """One call into the linked object: ``entry(<buffers by index>, <ints>)``, the runtime's
    calling convention (pointers first, then ints)."""

    entry: str
    buffers: Sequence[int]
    ints: Sequence[int] = ()


class Harness:
    """One harness process: its reservation's base and its libm/libc functions' addresses."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen(
            ["qemu-aarch64", str(path), hex(SPAN)],
            cwd=path.parent,  # a core file of a crash lands in the test's folder
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        resource.prlimit(self.proc.pid, resource.RLIMIT_CORE, (0, 0))  # before any code runs
        assert self.proc.stdout is not None
        self.symbols: dict[str, int] = {}
        # only whole lines are read here: the harness writes nothing more until it has read all
        # of its commands, so communicate() below misses nothing this buffered reader took
        while (line := self.proc.stdout.readline().decode()) != "end\n":
            assert line, self.proc.communicate(timeout=60)[1].decode()
            name, addr = line.split()
            self.symbols[name] = int(addr, 16)
        self.base = self.symbols.pop("base")
        self.code_base, self.data_base = self.base, self.base + GAP + DATA_SKEW

    def run(self, lib: bytes, calls: Sequence[Call], arrays: Sequence[Any]) -> list[Any]:
        """Link ``lib`` for this harness's addresses, place it, make ``calls``; the arrays after them."""
        obj = elf.parse(lib)
        layout = elf.plan(obj)
        assert layout.code_size < GAP and layout.data_size < SPAN - GAP - DATA_SKEW
        code, data, symbols = elf.link(obj, layout, self.code_base, self.data_base, self.symbols.get)
        blobs: list[bytes] = []

        def send(*values: int, blob: bytes = b"") -> None:
            blobs.append(struct.pack(f"<{len(values)}Q", *values) + blob)

        send(ord("P"), self.code_base, len(code), 1, blob=bytes(code))
        if data:
            send(ord("P"), self.data_base, len(data), 0, blob=bytes(data))
        for array in arrays:
            send(ord("B"), array.nbytes, blob=np.ascontiguousarray(array).tobytes())
        for call in calls:
            args = [(1, i) for i in call.buffers] + [(0, v & (2**64 - 1)) for v in call.ints]
            words = [v for pair in args for v in pair]
            send(ord("C"), symbols[call.entry], len(args), *words)
        send(ord("E"))
        try:
            out, err = self.proc.communicate(b"".join(blobs), timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            raise
        assert self.proc.returncode == 0, f"the harness exited with {self.proc.returncode}: {err.decode()}"
        results, at = [], 0
        for array in arrays:
            results.append(np.frombuffer(out[at : at + array.nbytes], array.dtype).reshape(array.shape))
            at += array.nbytes
        assert at == len(out)
        return results


def aarch64_object(compiler: list[str], src: str, folder: Path, extra: Sequence[str] = ()) -> bytes:
    """``src`` compiled for AArch64 with the CPU compiler's flags, then ``extra``."""
    path = folder / f"{uuid.uuid4().hex}.c"
    path.write_text(src)
    out = path.with_suffix(".o")
    argv = [*compiler, *OBJECT_FLAGS, *extra, str(path), "-o", str(out)]
    subprocess.run(argv, check=True, capture_output=True)
    return out.read_bytes()


DTYPES: dict[Any, DType] = {np.dtype(np.float32): dtypes.float32, np.dtype(np.int32): dtypes.int32}


async def run_native(src: str, calls: Sequence[Call], arrays: Sequence[Any]) -> list[Any]:
    """The same calls made by the CPU device (this machine), on copies of the same arrays."""
    dev = Device["CPU"]
    first = await dev.program(calls[0].entry, src)
    progs = {calls[0].entry: first}
    bufs = []
    for array in arrays:
        buf = await Buffer("CPU", array.size, DTYPES[array.dtype]).allocate()
        await buf.copyin(np.ascontiguousarray(array))
        bufs.append(buf)
    for call in calls:
        prog = progs.setdefault(call.entry, dev.runtime(call.entry, first.lib))
        await dev.run(prog, *(bufs[i] for i in call.buffers), vals=tuple(call.ints))
    results = []
    for buf, array in zip(bufs, arrays, strict=True):
        results.append((await buf.numpy()).reshape(array.shape))
        await buf.free()
    return results


async def both(
    harness: Path,
    compiler: list[str],
    src: str,
    calls: Sequence[Call],
    arrays: Sequence[Any],
    extra: Sequence[str] = (),
) -> tuple[list[Any], list[Any], elf.ElfObject]:
    """Run ``calls`` on AArch64 (under qemu, the object compiled with ``extra`` flags too) and
    natively; both sides' arrays and the AArch64 object."""
    lib = aarch64_object(compiler, src, harness.parent, extra)
    return Harness(harness).run(lib, calls, arrays), await run_native(src, calls, arrays), elf.parse(lib)


def relocations(obj: elf.ElfObject) -> set[str]:
    """The relocation kinds of ``obj``, and ``KIND->block`` for those against a symbol the
    object defines in its code or data block."""
    found = set()
    for _, _, rtype, sym_index, _ in obj.relocations:
        kind = obj.reloc_name(rtype).removeprefix("R_AARCH64_")
        section = obj.sections.get(obj.symbols[sym_index].shndx)
        found |= {kind, f"{kind}->{section.block}"} if section is not None else {kind}
    return found


@pytest.fixture
def cpu_buffers() -> Iterator[None]:
    """Device["CPU"] is shared with later test files: every buffer a test allocates is freed."""
    before = Device["CPU"].allocator.statistics().bytes_in_use
    yield
    assert Device["CPU"].allocator.statistics().bytes_in_use == before


# ---- the tests --------------------------------------------------------------------------------------

TABLES_SRC = """
#include <math.h>
static const float table[8] = {1, 2, 3, 4, 5, 6, 7, 8};
static const double wide[2] = {0.5, 0.25};
static const char *const names[3] = {"a", "bc", "def"};
typedef float (*unary)(float);
unary fns[2] = {expf, sinf};
int counter;
static int step = 3;
double gd = 2.0;
long long big[4096];
static int ring[8] = {10, 11, 12, 13, 14, 15, 16, 17};
int *cursor[2] = {&ring[3], &ring[6]};
__attribute__((noinline)) float helper(float x) { return expf(x) + sinf(x); }
__attribute__((noinline)) float tail(float x) { return powf(x, 1.5f); }
void k(float *restrict out, const float *restrict in, int *restrict state, int n) {
  for (int i = 0; i < n; i++) {
    float x = in[i];
    out[i] = helper(x) * table[i & 7] + (float)gd + (float)wide[i & 1] + tail(fabsf(x) + 1.0f)
           + fns[i & 1](x) + (float)names[i % 3][i % 3 == 2 ? 2 : 0];
  }
  counter += step;
  big[4095] += 1;
  state[0] = counter;
  state[1] = (int)big[4095];
  state[2] = *cursor[0] + 100 * *cursor[1];
  cursor[0][0] += 1;
  step++;
}
"""


async def test_tables_globals_calls_and_libm_run_as_on_x86_64(harness: Path, compiler: list[str]) -> None:
    """Read-only tables (adrp + add/ldr of .rodata), pointers in data (ABS64: into an array,
    and to libm's expf and sinf), globals in .data and .bss through the GOT and a static one
    reached directly by adrp across the gap, calls within the object (CALL26), a tail call
    (JUMP26) and libm calls through stubs; globals keep their values between calls."""
    x = np.linspace(-3, 3, 37, dtype=np.float32)
    arrays = [np.zeros(x.size, np.float32), x, np.zeros(3, np.int32)]
    calls = [Call("k", [0, 1, 2], [x.size])] * 3
    (out, _, state), (want, _, want_state), obj = await both(harness, compiler, TABLES_SRC, calls, arrays)
    assert {
        *("CALL26->code", "JUMP26", "ABS64", "ABS64->data", "ADD_ABS_LO12_NC->code"),
        *("ADR_PREL_PG_HI21->code", "ADR_PREL_PG_HI21->data", "LDST32_ABS_LO12_NC->data"),
        *("ADR_GOT_PAGE", "LD64_GOT_LO12_NC"),
        *(["PREL32"] if compiler[0] == "clang" else []),  # clang makes names[] a table of offsets
    } <= relocations(obj)
    assert state.tolist() == want_state.tolist() == [3 + 4 + 5, 3, 13 + 2 + 100 * 16]
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)
    assert np.isfinite(out).all() and np.abs(out).max() > 10


async def test_the_large_code_model_runs_as_well(harness: Path, compiler: list[str]) -> None:
    """``-mcmodel=large``: absolute addresses built by movz/movk (MOVW_UABS_G0..G3, clang) or
    read from literal pools (ABS64 + LDST64, gcc). The CPU compiler does not ask for it; the
    loader applies these relocations all the same."""
    x = np.linspace(-3, 3, 37, dtype=np.float32)
    arrays = [np.zeros(x.size, np.float32), x, np.zeros(3, np.int32)]
    calls = [Call("k", [0, 1, 2], [x.size])] * 3
    large = ["-mcmodel=large", "-fno-pic"]
    (out, _, state), (want, _, want_state), obj = await both(
        harness, compiler, TABLES_SRC, calls, arrays, large
    )
    kinds = relocations(obj)
    if compiler[0] == "clang":
        assert {"MOVW_UABS_G0_NC", "MOVW_UABS_G1_NC", "MOVW_UABS_G2_NC", "MOVW_UABS_G3"} <= kinds
    else:
        assert {"ABS64->code", "ABS64->data", "LDST64_ABS_LO12_NC->code"} <= kinds
    assert state.tolist() == want_state.tolist() == [3 + 4 + 5, 3, 13 + 2 + 100 * 16]
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)


SEVERAL_SRC = """
int twice(int x) { return 2 * x; }
__attribute__((noinline)) int plus_one(int x) { return x + 1; }
static __attribute__((noinline)) int thrice(int x) { return 3 * x; }
void first(int *restrict out, int v) { out[0] = twice(plus_one(v)) + thrice(v); }
void second(int *restrict out, int v) { out[1] = plus_one(twice(v)) - v; }
"""


async def test_each_function_of_an_object_is_an_entry_and_they_call_each_other(
    harness: Path, compiler: list[str]
) -> None:
    arrays = [np.zeros(2, np.int32)]
    calls = [Call("first", [0], [5]), Call("second", [0], [-7])]
    (out,), (want,), obj = await both(harness, compiler, SEVERAL_SRC, calls, arrays)
    assert "CALL26" in relocations(obj)
    assert out.tolist() == want.tolist() == [27, -14 + 1 + 7]


VECTOR_SRC = """
typedef float float4 __attribute__((vector_size(16)));
void vec(float *restrict out, const float *restrict x, int n) {
  const float4 k = {1.5f, -2.0f, 3.25f, 0.125f}, m = {7.0f, 0.5f, -1.0f, 2.0f};
  for (int i = 0; i + 4 <= n; i += 4) {
    float4 v = *(const float4 *)(x + i);
    *(float4 *)(out + i) = v * k + m;
  }
}
"""


async def test_vector_constants_load_with_128_bit_offsets(harness: Path, compiler: list[str]) -> None:
    x = np.arange(64, dtype=np.float32) - 20
    arrays = [np.zeros(64, np.float32), x]
    (out, _), (want, _), obj = await both(harness, compiler, VECTOR_SRC, [Call("vec", [0, 1], [64])], arrays)
    assert "LDST128_ABS_LO12_NC" in relocations(obj)
    np.testing.assert_array_equal(out, want)
    k, m = np.array([1.5, -2, 3.25, 0.125], np.float32), np.array([7, 0.5, -1, 2], np.float32)
    np.testing.assert_array_equal(out, (x.reshape(-1, 4) * k + m).ravel())


def f32(name: str, access: str = "r") -> BufferParam:
    return BufferParam(name, dtypes.float32, access)  # type: ignore[arg-type]


RENDERED = Kernel(
    "act",
    [f32("out", "w"), f32("x"), f32("y"), IntParam("scale"), IntParam("shift")],
    """
    float32 v = x[gidx1 * gsz0 + gidx0];
    float32 acc = 0.0f;
    for (int j = 0; j < 4; j++) {
      acc += pow(fabs(v) + 1.0f, 0.25f * (float32)j) * y[(gidx0 + j) % gsz0];
    }
    out[gidx1 * gsz0 + gidx0] = exp(v * 0.5f) * (float32)scale + sin(acc) + tanh(v) - (float32)shift;
    """,
)


async def test_a_clang_renderer_kernel_split_across_cores(harness: Path, compiler: list[str]) -> None:
    """tinygrad's calling convention: three buffers, two ints, the global size and core_id,
    core_count: more arguments than registers (the last ones on the stack)."""
    src = ClangRenderer().render(RENDERED)
    gsz = (16, 5, 1)
    rng = np.random.default_rng(19)
    x = rng.uniform(-2, 2, 80).astype(np.float32)
    y = rng.uniform(-1, 1, 16).astype(np.float32)
    arrays = [np.zeros(80, np.float32), x, y]
    launch = RENDERED.launch_vals((3, -2), gsz)
    calls = [Call("act", [0, 1, 2], [*launch, core, 3]) for core in (2, 0, 1)]
    (out, _, _), (want, _, _), obj = await both(harness, compiler, src, calls, arrays)
    assert {"CALL26"} <= relocations(obj)  # powf, expf, sinf, tanhf: stubs
    np.testing.assert_allclose(out, want, rtol=2e-6, atol=2e-6)
    assert np.count_nonzero(out) == out.size
