"""CPU programs as relocatable objects: the ELF loader (aiotinyrt.host.elf) and its arenas.

Kernels with read-only tables, globals, several functions, libm calls, vector extensions and a
size beyond one arena run as they did as shared objects; a bad object is a CompileError naming
what is wrong; code is never writable and executable at once; 20,000 programs loaded and dropped
keep the process's mapping count bounded. AArch64 relocations are checked by linking a
cross-compiled object at a chosen address and disassembling the result with llvm-objdump.
"""

from __future__ import annotations

import random
import re
import shutil
import struct
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from aiotinyrt import Buffer, CompileError, Device, dtypes
from aiotinyrt.backends.ops_cpu import CPUProgram
from aiotinyrt.helpers import find_cc
from aiotinyrt.host import arena, elf
from aiotinyrt.host.compiler import ClangCompiler

pytestmark = pytest.mark.anyio


async def floats(values: Any) -> Buffer:
    array = np.ascontiguousarray(values, dtype=np.float32)
    buf = await Buffer("CPU", array.size, dtypes.float32).allocate()
    await buf.copyin(array)
    return buf


async def ints(n: int) -> Buffer:
    buf = await Buffer("CPU", n, dtypes.int32).allocate()
    await buf.copyin(np.zeros(n, np.int32))
    return buf


@pytest.fixture(autouse=True)
def _no_buffer_left_behind() -> Iterator[None]:
    """Device["CPU"] is shared with later test files (which count its bytes in use): every
    buffer a test here allocates is freed by the test."""
    allocator = Device["CPU"].allocator
    before = allocator.statistics().bytes_in_use
    yield
    assert allocator.statistics().bytes_in_use == before


def image(prog: Any) -> elf.LoadedObject:
    assert isinstance(prog, CPUProgram)
    return prog.image


def undefined_symbols(lib: bytes) -> set[str]:
    return {s.name for s in elf.parse(lib).symbols if s.shndx == 0 and s.name}


def compile_with(argv: list[str], src: str, tmp_path: Path) -> bytes:
    path = tmp_path / f"{uuid.uuid4().hex}.c"
    path.write_text(src)
    out = tmp_path / "out.bin"
    subprocess.run([*argv, "-x", "c", str(path), "-o", str(out)], check=True, capture_output=True)
    return out.read_bytes()


# ---- what the compiler makes ------------------------------------------------------------------------


async def test_the_cpu_compiler_makes_a_relocatable_object_and_its_cache_key_says_so() -> None:
    dev = Device["CPU"]
    lib = await dev.compiler.compile_cached(f"// {uuid.uuid4()}\nvoid k(int *out) {{ out[0] = 1; }}\n")
    assert lib[:4] == b"\x7fELF" and struct.unpack_from("<H", lib, 16)[0] == 1  # ET_REL
    compiler = dev.compiler
    assert isinstance(compiler, ClangCompiler)
    assert compiler.cachekey == "compile_cpu_obj" and "-shared" not in compiler.FLAGS
    identity = await compiler.identity()
    assert identity.startswith("elf-relocatable|") and "|-c|" in identity


async def test_disassemble_is_objdump_of_the_object_with_its_relocations() -> None:
    dev = Device["CPU"]
    lib = await dev.compiler.compile_cached("float expf(float);\nvoid k(float *o) { o[0] = expf(o[0]); }\n")
    text = dev.compiler.disassemble(lib)
    assert "<k>:" in text and "expf" in text and "R_" in text


async def test_math_h_functions_in_raw_c_stay_compiler_builtins() -> None:
    """As with the shared object: sqrtf, fabsf and floorf become instructions (and the loop can
    vectorize), not calls into libm, which -ffreestanding (implying -fno-builtin) would make them."""
    dev = Device["CPU"]
    src = (
        "#include <math.h>\n"
        "void k(float *restrict o, const float *restrict x, int n) {\n"
        "  for (int i = 0; i < n; i++) o[i] = sqrtf(fabsf(x[i])) + floorf(x[i]);\n"
        "}\n"
    )
    prog = await dev.program("k", src)
    assert not {"sqrtf", "fabsf", "floorf"} & undefined_symbols(prog.lib)


# ---- kernels that use what a linker used to resolve --------------------------------------------------


async def test_a_static_const_table_in_rodata_is_read_by_the_kernel() -> None:
    dev = Device["CPU"]
    table = [float((i * 37) % 101) / 7 for i in range(256)]
    src = (
        f"static const float table[256] = {{{', '.join(f'{v!r}f' for v in table)}}};\n"
        'const char *names[3] = {"a", "bc", "def"};\n'  # pointers in data: R_X86_64_64 relocations
        "void lut(float *restrict out, const int *restrict idx, int n) {\n"
        "  for (int i = 0; i < n; i++) out[i] = table[idx[i] & 255] + (float)names[i % 3][0];\n"
        "}\n"
    )
    prog = await dev.program("lut", src)
    idx = np.arange(0, 2000, 7, dtype=np.int32)
    ib = await Buffer("CPU", idx.size, dtypes.int32).allocate()
    await ib.copyin(idx)
    out = await floats(np.zeros(idx.size))
    await dev.run(prog, out, ib, vals=(idx.size,))
    letters = np.array([ord("a"), ord("b"), ord("d")], np.float32)[np.arange(idx.size) % 3]
    want = np.array(table, np.float32)[idx & 255] + letters
    np.testing.assert_array_equal(await out.numpy(), want)
    await ib.free()
    await out.free()


async def test_globals_keep_their_values_between_launches_and_each_program_has_its_own() -> None:
    dev = Device["CPU"]
    src = (
        "int calls;\nstatic int step = 3;\nlong long big[4096];\n"  # .bss, .data, a large .bss
        "void count(int *restrict out) {\n"
        "  calls += step; big[4095] += 1; out[0] = calls; out[1] = (int)big[4095];\n"
        "}\n"
    )
    one = await dev.program("count", src)
    two = dev.runtime("count", one.lib)  # the same object, loaded again: its own globals
    out = await ints(2)
    for _ in range(3):
        await dev.run(one, out)
    assert (await out.numpy()).tolist() == [9, 3]
    await dev.run(two, out)
    assert (await out.numpy()).tolist() == [3, 1]
    await out.free()


async def test_an_object_with_several_functions_calls_between_them_and_exposes_each() -> None:
    dev = Device["CPU"]
    src = (
        "int twice(int x) { return 2 * x; }\n"
        "__attribute__((noinline)) int plus_one(int x) { return x + 1; }\n"
        "static __attribute__((noinline)) int thrice(int x) { return 3 * x; }\n"
        "void first(int *restrict out, int v) { out[0] = twice(plus_one(v)) + thrice(v); }\n"
        "void second(int *restrict out, int v) { out[1] = plus_one(twice(v)); }\n"
    )
    first = await dev.program("first", src)
    second = dev.runtime("second", first.lib)
    assert {"twice", "plus_one", "first", "second"} <= set(image(first).symbols)
    assert "thrice" not in image(first).symbols  # static: not exported
    out = await ints(2)
    await dev.run(first, out, vals=(5,))
    await dev.run(second, out, vals=(5,))
    assert (await out.numpy()).tolist() == [27, 11]
    await out.free()


async def test_libm_functions_are_resolved_from_the_process() -> None:
    dev = Device["CPU"]
    src = (
        "#include <math.h>\n"
        "void m(float *restrict out, const float *restrict x, int n) {\n"
        "  for (int i = 0; i < n; i++) out[i] = expf(x[i]) + sinf(x[i]) * powf(fabsf(x[i]) + 1.0f, 1.5f);\n"
        "}\n"
    )
    prog = await dev.program("m", src)
    assert {"expf", "sinf", "powf"} <= undefined_symbols(prog.lib)  # calls the loader linked
    x = np.linspace(-4, 4, 97, dtype=np.float32)
    xb, out = await floats(x), await floats(np.zeros(x.size))
    await dev.run(prog, out, xb, vals=(x.size,))
    want = np.exp(x) + np.sin(x) * np.power(np.abs(x) + 1, np.float32(1.5))
    np.testing.assert_allclose(await out.numpy(), want, rtol=1e-6, atol=1e-6)
    await xb.free()
    await out.free()


async def test_vector_extensions_run() -> None:
    dev = Device["CPU"]
    src = (
        "typedef float float4 __attribute__((vector_size(16)));\n"
        "typedef float float8 __attribute__((vector_size(32), aligned(4)));\n"
        "void vec(float *restrict out, const float *restrict x, int n) {\n"
        "  const float4 k = {1.0f, 2.0f, 3.0f, 4.0f};\n"
        "  for (int i = 0; i + 8 <= n; i += 8) {\n"
        "    float8 v = *(const float8 *)(x + i);\n"
        "    float4 lo = {v[0], v[1], v[2], v[3]}, hi = {v[4], v[5], v[6], v[7]};\n"
        "    float4 r = lo * k + hi;\n"
        "    for (int j = 0; j < 4; j++) out[i / 2 + j] = r[j];\n"
        "  }\n"
        "}\n"
    )
    prog = await dev.program("vec", src)
    x = np.arange(64, dtype=np.float32)
    xb, out = await floats(x), await floats(np.zeros(32))
    await dev.run(prog, out, xb, vals=(64,))
    rows = x.reshape(8, 8)
    want = (rows[:, :4] * np.array([1, 2, 3, 4], np.float32) + rows[:, 4:]).ravel()
    np.testing.assert_array_equal(await out.numpy(), want)
    await xb.free()
    await out.free()


@pytest.mark.slow
async def test_a_large_kernel_and_an_object_larger_than_an_arena_run() -> None:
    dev = Device["CPU"]
    terms = "\n".join(
        f"  acc = acc * {1 + i % 5}.0f / {2 + i % 3}.0f + x[(i + {i}) % n] * {i}.0f; out[{i} % n] += acc;"
        for i in range(1500)
    )
    head = "void big(float *restrict out, const float *restrict x, int n, int i) {\n  float acc = 0;\n"
    src = f"{head}{terms}\n}}\n"
    prog = await dev.program("big", src)
    text = next(s for s in elf.parse(prog.lib).sections.values() if s.name == ".text")
    assert text.size > 16 * arena.PAGE  # many pages of code
    # a table bigger than an arena's code part: the object gets an arena of its own
    n = arena.CODE_BYTES // 4 + 1024
    table = f"static const int table[{n}] = {{[0] = 3, [{n - 1}] = 7}};\n"
    huge = await dev.program(
        "huge", table + "void huge(int *restrict o, int i) { o[0] = table[i] + table[0]; }\n"
    )
    assert image(huge).allocation.code_size > arena.CODE_BYTES
    out = await ints(1)
    await dev.run(huge, out, vals=(n - 1,))
    assert (await out.numpy()).tolist() == [10]
    xs, outs = await floats(np.ones(7)), await floats(np.zeros(7))
    await dev.run(prog, outs, xs, vals=(7, 0))
    assert np.isfinite(await outs.numpy()).all()
    for b in (out, xs, outs):
        await b.free()


# ---- bad objects: a CompileError that names the problem ----------------------------------------------


async def test_an_unresolved_symbol_is_a_compile_error_naming_it() -> None:
    dev = Device["CPU"]
    src = "void no_such_function_anywhere(int *);\nvoid k(int *o) { no_such_function_anywhere(o); }\n"
    with pytest.raises(CompileError, match="no_such_function_anywhere") as info:
        await dev.program("k", src)
    assert isinstance(info.value, ValueError)  # bad input to runtime() as well


async def test_thread_local_storage_is_a_compile_error_naming_it() -> None:
    dev = Device["CPU"]
    with pytest.raises(CompileError, match=r"thread-local storage \(section \.tbss"):
        await dev.program("k", "__thread int t;\nvoid k(int *o) { o[0] = ++t; }\n")


async def test_an_unsupported_relocation_is_a_compile_error_naming_it() -> None:
    dev = Device["CPU"]
    lib = bytearray(
        await dev.compiler.compile_cached("float expf(float);\nvoid k(float *o) { o[0] = expf(o[0]); }\n")
    )
    obj = elf.parse(bytes(lib))
    assert obj.relocations
    # rewrite the type of every relocation to R_X86_64_TPOFF32 (23) / R_AARCH64_TLSLE_ADD_TPREL_HI12 (549)
    rtype = 23 if obj.machine == elf.EM_X86_64 else 549
    ehdr = struct.unpack_from("<16sHHIQQQIHHHHHH", lib)
    shoff, shnum = ehdr[6], ehdr[12]
    for i in range(shnum):
        _, stype, _, _, offset, size, *_ = struct.unpack_from("<IIQQQQIIQQ", lib, shoff + 64 * i)
        if stype == 4:
            for at in range(offset, offset + size, 24):
                info = struct.unpack_from("<Q", lib, at + 8)[0]
                struct.pack_into("<Q", lib, at + 8, (info & ~0xFFFFFFFF) | rtype)
    name = elf.X86_64_RELOCS[23] if obj.machine == elf.EM_X86_64 else elf.AARCH64_RELOCS[549]
    with pytest.raises(CompileError, match=f"unsupported relocation {name}"):
        dev.runtime("k", bytes(lib))


async def test_objects_that_are_not_relocatable_objects_for_this_machine_are_refused(tmp_path: Path) -> None:
    dev = Device["CPU"]
    cc = find_cc()
    assert cc is not None
    src = "void k(int *o) { o[0] = 1; }\n"
    shared = compile_with([*cc, "-shared", "-fPIC"], src, tmp_path)
    with pytest.raises(CompileError, match="not a relocatable object: a shared object"):
        dev.runtime("k", shared)
    with pytest.raises(CompileError, match="not an ELF object"):
        dev.runtime("k", b"definitely not an object")
    good = await dev.compiler.compile_cached(src)
    with pytest.raises(CompileError, match="malformed"):
        dev.runtime("k", good[:100])
    clang = shutil.which("clang")
    if clang is not None:  # an object for the other architecture
        other = "aarch64-linux-gnu" if elf.host_machine() == elf.EM_X86_64 else "x86_64-linux-gnu"
        foreign = compile_with([clang, f"--target={other}", "-c", "-O2", "-fPIC"], src, tmp_path)
        with pytest.raises(CompileError, match="cannot run on"):
            dev.runtime("k", foreign)


# ---- memory: write, then execute; shared arenas; bounded mappings -----------------------------------


def _maps_of(lo: int, hi: int) -> list[str]:
    """The permission strings of every mapping of /proc/self/maps that overlaps [lo, hi)."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, perms = line.split()[:2]
        start, end = (int(x, 16) for x in span.split("-"))
        if start < hi and end > lo:
            found.append(perms)
    return found


@pytest.mark.slow
async def test_code_is_never_writable_and_executable_and_many_programs_share_two_mappings() -> None:
    dev = Device["CPU"]
    src = "int g;\nvoid k(int *o, int v) { g += v; o[0] = g; }\n"
    lib = await dev.compiler.compile_cached(src)
    progs = [dev.runtime("k", lib) for _ in range(200)]
    allocations = [image(p).allocation for p in progs]
    arenas = {id(a.arena): a.arena for a in allocations}
    assert len(arenas) <= 2  # 200 programs, one or two arenas
    for a in arenas.values():
        perms = _maps_of(a.base, a.base + a.size)
        assert not any("w" in p and "x" in p for p in perms), perms
        assert perms.count("r-xp") >= 1 and len(perms) <= 2 + 2 * len(arenas), perms
    for alloc in allocations:
        assert _maps_of(alloc.code, alloc.code + alloc.code_size) == ["r-xp"]
        assert _maps_of(alloc.data, alloc.data + 16) == ["rw-p"]
    out = await ints(1)
    for i, p in enumerate(progs):
        await dev.run(p, out, vals=(i,))
        assert (await out.numpy()).tolist() == [i]  # each program has its own g
    await out.free()


def test_arena_space_comes_back_and_an_empty_arena_is_unmapped() -> None:
    pool = arena.ArenaPool(code_bytes=16 * arena.PAGE, data_bytes=arena.PAGE)
    first = [pool.allocate(arena.PAGE, 100) for _ in range(16)]
    assert pool.statistics() == (1, 16)
    second = pool.allocate(3 * arena.PAGE, 0)  # the first arena is full
    assert pool.statistics() == (2, 17)
    for a in first:
        pool.release(a)
    assert pool.statistics() == (1, 1)  # the empty arena went
    assert _maps_of(first[0].arena.base, first[0].arena.base + first[0].arena.size) == []
    again = [pool.allocate(arena.PAGE, 0) for _ in range(13)]  # fills the rest of the second arena
    assert pool.statistics() == (1, 14) and {a.arena for a in again} == {second.arena}
    big = pool.allocate(64 * arena.PAGE, 3 * arena.PAGE)  # larger than an arena: its own
    assert big.arena.size >= 64 * arena.PAGE and pool.statistics() == (2, 15)
    pool.release(big)
    assert pool.statistics() == (1, 14)


def test_a_release_from_a_collector_callback_inside_allocate_is_applied_later() -> None:
    pool = arena.ArenaPool(code_bytes=4 * arena.PAGE, data_bytes=arena.PAGE)
    held = pool.allocate(arena.PAGE, 0)
    with pool._lock:  # as if the collector ran the release while this thread allocates
        pool.release(held)
    assert pool.statistics() == (1, 0)


async def test_a_refused_mapping_raises_memory_error_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """What vm.max_map_count exhausted looks like to the loader: mmap fails with ENOMEM."""
    lib = await Device["CPU"].compiler.compile_cached("void k(int *o) { o[0] = 1; }")
    real = arena._mm

    class Refusing:
        def mmap(self, *args: Any) -> Any:
            return arena._ffi.cast("void *", -1)

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

    monkeypatch.setattr(arena, "_mm", Refusing())
    pool = arena.ArenaPool()
    with pytest.raises(MemoryError, match="cannot map"):
        elf.load(lib, pool=pool)
    assert pool.statistics() == (0, 0)


MAPPINGS_PROGRAM = textwrap.dedent(
    """
    import struct, anyio
    from aiotinyrt import Buffer, Device, dtypes

    def mappings():
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)

    async def main():
        dev = Device["CPU"]
        lib = await dev.compiler.compile_cached("void k(int *restrict o) { o[0] = 0x5eed1234; }")
        at = lib.index(struct.pack("<I", 0x5EED1234))  # the immediate: one distinct program per value
        out = await Buffer("CPU", 1, dtypes.int32).allocate()
        start = peak = 0
        for i in range(20100):  # the first 100: threads, numpy's libraries, the first arena
            if i == 100:
                start = peak = mappings()
            prog = dev.runtime("k", lib[:at] + struct.pack("<I", i) + lib[at + 4:])
            await dev.run(prog, out)
            if i % 997 == 0:
                assert (await out.numpy()).tolist() == [i]
                peak = max(peak, mappings())
            del prog
        print(start, peak, mappings())

    anyio.run(main)
    """
)


@pytest.mark.slow
def test_20000_programs_loaded_used_and_dropped_keep_the_mapping_count_bounded() -> None:
    result = subprocess.run(
        [sys.executable, "-c", MAPPINGS_PROGRAM], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]
    start, peak, end = map(int, result.stdout.split())
    assert peak - start <= 8 and end - start <= 8, (start, peak, end)


# ---- AArch64: link a cross-compiled object at a chosen address, disassemble, check the targets ----

AARCH64_SRC = """
static const float table[8] = {1, 2, 3, 4, 5, 6, 7, 8};
static const double wide[2] = {0.5, 0.25};
int counter;
double gd = 2.0;
float expf(float); float sinf(float);
__attribute__((noinline)) float helper(float x) { return expf(x) + sinf(x); }
void k(float *restrict out, const float *restrict in, int n) {
  for (int i = 0; i < n; i++) out[i] = helper(in[i]) * table[i & 7] + (float)gd + (float)wide[i & 1];
  counter++;
}
"""


def test_aarch64_relocations_point_at_their_symbols(tmp_path: Path) -> None:
    clang, objdump = shutil.which("clang"), shutil.which("llvm-objdump")
    objcopy = shutil.which("llvm-objcopy")
    if clang is None or objdump is None or objcopy is None:
        pytest.skip("needs clang, llvm-objdump and llvm-objcopy (apt-get install -y clang llvm)")
    flags = ["--target=aarch64-linux-gnu", "-c", "-O2", "-fPIC", "-ffreestanding", "-fno-math-errno"]
    obj = elf.parse(compile_with([clang, *flags], AARCH64_SRC, tmp_path))
    kinds = {obj.reloc_name(r[2]) for r in obj.relocations}
    assert {"R_AARCH64_CALL26", "R_AARCH64_ADR_PREL_PG_HI21", "R_AARCH64_ADR_GOT_PAGE"} <= kinds
    layout = elf.plan(obj)
    code_base, data_base = 0x7F12_3456_7000, 0x7F12_3456_7000 + 0x1234_5000  # pages apart: adrp counts
    external = {"expf": 0x7FFF_0000_1000, "sinf": 0x7FFF_0000_2040}
    code, data, symbols = elf.link(obj, layout, code_base, data_base, external.get)
    (tmp_path / "code.bin").write_bytes(bytes(code))
    subprocess.run(
        [objcopy, "-I", "binary", "-O", "elf64-littleaarch64", "code.bin", "code.elf"],
        cwd=tmp_path,
        check=True,
    )
    listing = subprocess.run(
        [objdump, "-d", "-j", ".data", "--triple=aarch64", f"--adjust-vma={code_base:#x}", "code.elf"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    stubs = {obj.symbols[i].name: code_base + at for i, at in layout.stubs.items()}
    got = {obj.symbols[i].name: code_base + at for i, at in layout.got.items()}
    calls = {int(m, 16) for m in re.findall(r"\bbl\s+0x([0-9a-f]+)", listing)}
    assert calls == {symbols["helper"], stubs["expf"], stubs["sinf"]}
    for name, at in stubs.items():  # each stub jumps to the address it holds
        assert struct.unpack_from("<Q", code, at - code_base + 8)[0] == external[name]
    for name, at in got.items():  # each GOT slot holds its symbol's address
        assert struct.unpack_from("<Q", code, at - code_base)[0] == symbols[name]
    # adrp + add/ldr pairs: page + low 12 bits must land on a GOT slot or a rodata section
    pages: dict[str, int] = {}
    reached = set()
    for line in listing.splitlines():
        if m := re.search(r"\badrp\s+(x\d+), 0x([0-9a-f]+)", line):
            pages[m.group(1)] = int(m.group(2), 16)
        elif (m := re.search(r"\b(?:add|ldr)\s+[xsdq]\d+, \[?(x\d+), #(\d+)\]?", line)) and m.group(
            1
        ) in pages:
            reached.add(pages.pop(m.group(1)) + int(m.group(2)))
    rodata = {
        code_base + layout.offsets[s.number][1] for s in obj.sections.values() if s.name.startswith(".rodata")
    }
    assert set(got.values()) <= reached
    assert rodata & reached, (sorted(map(hex, reached)), sorted(map(hex, rodata)))
    assert (
        symbols["gd"]
        == data_base + layout.offsets[next(s.number for s in obj.sections.values() if s.name == ".data")][1]
    )
    assert len(data) == layout.data_size


async def test_damaged_objects_load_or_raise_compile_error_never_anything_else() -> None:
    dev = Device["CPU"]
    good = await dev.compiler.compile_cached(
        "#include <math.h>\nint g;\nstatic const float t[4] = {1, 2, 3, 4};\n"
        "void k(float *o, int i) { o[0] = expf(t[i & 3]) + (float)++g; }\n"
    )
    rng = random.Random(19)
    damaged = [good[:n] for n in range(0, len(good), 7)]
    for _ in range(300):
        flipped = bytearray(good)
        for _ in range(rng.randint(1, 4)):
            flipped[rng.randrange(len(flipped))] = rng.randrange(256)
        damaged.append(bytes(flipped))
    outcomes = {"loaded": 0, "refused": 0}
    for blob in damaged:
        try:
            elf.load(blob)  # loaded, never run: a flipped code byte is the compiler's business
        except CompileError:
            outcomes["refused"] += 1
        else:
            outcomes["loaded"] += 1
    assert outcomes["refused"] > len(good) // 7  # at least every truncation
