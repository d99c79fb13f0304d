"""The portable Kernel description and its C, OpenCL and CUDA renderers.

Most CPU tests render with ClangRenderer and run the source through ``dev.program(name, src)``,
calling the rendered convention by hand (buffers, ints, gsz0..2, core_id, core_count) so each
chunk of a split can be checked alone; ``dev.program(kernel)`` (the device renders, splits and
checks launches) has its own tests. OpenCL output is built and run on the machine's OpenCL
platform (PoCL) and compared with the CPU; CUDA output is compiled with nvcc.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import cffi
import numpy as np
import pytest

from aiotinyrt import Buffer, Device, dtypes, open_device
from aiotinyrt.dtype import ALL_DTYPES, DType
from aiotinyrt.helpers import find_cc
from aiotinyrt.kernel import (
    BufferParam,
    ClangRenderer,
    CUDARenderer,
    Decl,
    IntParam,
    Kernel,
    KernelError,
    OpenCLRenderer,
    Store,
    cpu_threads,
    render,
)
from tests.helpers import (
    CASES,
    CONVERT,
    EVERY_DTYPE,
    GRID,
    INTEGER_OPS,
    MATH,
    MATMUL,
    SAXPY,
    SPECIAL_F32,
    Case,
    NDArray,
    _every_dtype_inputs,
    bf16_reference,
    bf16_to_f32,
    f32,
    run_cpu,
)

pytestmark = pytest.mark.anyio


# ---- kernel construction: every mistake is a clear KernelError, before anything compiles ---------


def test_kernel_knows_its_buffers_scalars_and_writes() -> None:
    k = Kernel(
        "k",
        [IntParam("n"), BufferParam("a", dtypes.int8), BufferParam("o", dtypes.float16, "rw"), f32("w", "w")],
        "o[gidx0] = o[gidx0] + a[gidx0] * n; w[gidx0] = 1.0f;",
    )
    assert [b.name for b in k.buffers] == ["a", "o", "w"]
    assert [s.name for s in k.scalars] == ["n"]
    assert k.writes == (1, 2)
    assert k.read == {"a", "o"} and k.written == {"o", "w"}
    assert "Kernel k(" in repr(k)


def test_kernel_error_is_a_value_error() -> None:
    assert issubclass(KernelError, ValueError)


@pytest.mark.parametrize("dtype", ["float8", "complex64", "bfloat", ""])
def test_unknown_dtype_name_is_rejected(dtype: str) -> None:
    with pytest.raises(KernelError, match=rf"buffer 'a': unknown dtype {dtype!r}.*known dtypes: bool"):
        BufferParam("a", dtype)  # type: ignore[arg-type]


def test_foreign_dtype_instance_is_rejected() -> None:
    fake = DType("float8", 1, None, "unsigned char", "float")
    with pytest.raises(KernelError, match=r"unknown dtype dtypes.float8"):
        BufferParam("a", fake)


def test_non_dtype_is_rejected() -> None:
    with pytest.raises(KernelError, match="dtype must be a DType or a dtype name, got int"):
        BufferParam("a", 4)  # type: ignore[arg-type]


def test_dtype_names_and_aliases_are_accepted() -> None:
    assert BufferParam("a", "half").dtype is dtypes.float16  # type: ignore[arg-type]
    assert BufferParam("a", "bfloat16").dtype is dtypes.bfloat16  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["2x", "a-b", "", "a b", "x.y", "ñ", "a\n"])
def test_parameter_name_that_is_not_a_c_identifier_is_rejected(name: str) -> None:
    with pytest.raises(KernelError, match="is not a C identifier"):
        BufferParam(name, dtypes.float32)
    with pytest.raises(KernelError, match="is not a C identifier"):
        IntParam(name)


@pytest.mark.parametrize(
    "name", ["int", "float32", "kernel", "gidx0", "core_id", "__x", "aiotinyrt_a", "half"]
)
def test_reserved_parameter_name_is_rejected(name: str) -> None:
    with pytest.raises(KernelError, match="is reserved"):
        IntParam(name)


@pytest.mark.parametrize("name", ["sqrt", "expf", "min"])
def test_math_function_name_cannot_name_a_parameter(name: str) -> None:
    with pytest.raises(KernelError, match="is the name of a math function"):
        BufferParam(name, dtypes.float32)


def test_bad_kernel_name_is_rejected() -> None:
    with pytest.raises(KernelError, match="kernel name '1k' is not a C identifier"):
        Kernel("1k", [], "")
    with pytest.raises(KernelError, match="kernel name must be a str"):
        Kernel(None, [], "")  # type: ignore[arg-type]


def test_duplicate_parameter_is_rejected() -> None:
    with pytest.raises(KernelError, match="parameter 'a' is declared twice"):
        Kernel("k", [f32("a"), IntParam("a")], "")


def test_params_must_be_param_objects() -> None:
    with pytest.raises(KernelError, match="must be BufferParam or IntParam, got str"):
        Kernel("k", ["a"], "")  # type: ignore[list-item]


def test_bad_access_is_rejected() -> None:
    with pytest.raises(KernelError, match="access must be 'r', 'w' or 'rw', got 'x'"):
        BufferParam("a", dtypes.float32, "x")  # type: ignore[arg-type]


def test_body_naming_an_undeclared_parameter_is_rejected() -> None:
    with pytest.raises(KernelError) as info:
        Kernel("k", [f32("out", "w"), f32("a")], "out[gidx0] =\n  a[gidx0] + b[gidx0];")
    message = str(info.value)
    assert "kernel 'k', body line 2 column 14" in message
    assert "'b' is not declared" in message and "parameters: out, a" in message


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ("a[gidx0] = 1.0f;", "buffer 'a' is declared read-only"),
        ("out[gidx0] = out[gidx0];", "buffer 'out' is declared write-only"),
        ("out[gidx0] += 1.0f;", "buffer 'out' is declared write-only"),
        ("n = 3;", "'n' is read-only"),
        ("gidx0 = 3;", "'gidx0' is read-only"),
        ("out[gidx0] = a;", "buffer 'a' must be indexed"),
        ("out = 1.0f;", "buffer 'out' must be indexed"),
        ("out[a[0]] = 1.0f;", "an index must be an integer, got float32"),
        ("out[gidx0] = foo(1.0f);", "unknown function 'foo'"),
        ("out[gidx0] = sqrt(n);", r"sqrt\(\) needs float arguments, got int32"),
        ("out[gidx0] = pow(1.0f);", r"pow\(\) takes 2 arguments, got 1"),
        ("out[gidx0] = a[0] % 2.0f;", "operator '%' needs integer operands"),
        ("out[gidx0] = ~a[0];", "operator '~' needs an integer operand"),
        ("float16 h = 1.0f;", "float16 is a storage type"),
        ("out[gidx0] = (bfloat16)a[0];", "cannot cast to bfloat16"),
        ("int n = 1;", "shadows a parameter"),
        ("int x = 1; { int x = 2; }", "'x' is already declared"),
        ("int sqrt = 1;", "'sqrt' is reserved"),
        ("out[gidx0] = 1.0f", "expected ';', found the end of the body"),
        ("out[gidx0] = 1.0f; }", "expected a statement, found '}'"),
        ("if (n > 0) { out[0] = 1.0f;", "expected '}'"),
        ("out[gidx0] = 1.0f # 2;", "unexpected character '#'"),
        ("out[gidx0] = 99999999999999999999;", "is malformed or does not fit in 64 bits"),
        ("out[gidx0] = 09;", "is malformed"),
        ("while (1) { }", "'while' is not part of the kernel body language"),
        ("return;", "'return' is not part of the kernel body language"),
        ("out[gidx0] = n++;", r"'\+\+' is a statement, not an expression"),
        ("for (k = 0; k < n; k++) {}", "a for loop must declare its variable"),
        ("for (float k = 0; k < n; k++) {}", "a for loop variable must have an integer type"),
        ("for (int k = 0; k < n; n++) {}", "'n' is read-only"),
        ("int j = 0; for (int k = 0; k < n; j++) {}", "the step of a for loop must update its variable 'k'"),
        ("out[gidx0] = float32;", r"a type name \(float32\) cannot be used as a value"),
        ("out[gidx0] = n(1);", "'n' is not a function"),
        ("{ int t = 1; } out[gidx0] = t;", "'t' is not declared"),
    ],
)
def test_bad_body_is_rejected_with_a_clear_error(body: str, error: str) -> None:
    with pytest.raises(KernelError, match=error):
        Kernel("k", [f32("out", "w"), f32("a"), IntParam("n")], body)


def test_absurdly_nested_body_is_a_kernel_error() -> None:
    with pytest.raises(KernelError, match="nests too deeply"):
        Kernel("k", [f32("out", "w")], "out[0] = " + "(" * 5000 + "1" + ")" * 5000 + ";")


def test_global_size_of_zero_is_rejected() -> None:
    with pytest.raises(KernelError, match=r"global_size must be positive in every dimension, got \(4, 0\)"):
        Kernel("k", [], "", global_size=(4, 0))
    with pytest.raises(ValueError, match="must be positive"):
        SAXPY.launch_vals([2], global_size=(0,))
    with pytest.raises(ValueError, match="must be positive"):
        SAXPY.launch_size((8, 1, -1))
    with pytest.raises(TypeError, match="must hold ints"):
        SAXPY.launch_size((8.0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="1 to 3 dimensions"):
        SAXPY.launch_size((1, 1, 1, 1))
    with pytest.raises(KernelError, match="has no default global_size"):
        SAXPY.launch_size()


def test_launch_vals_appends_the_global_size_and_checks_vals() -> None:
    assert SAXPY.launch_vals([3], (16,)) == (3, 16, 1, 1)
    k = Kernel("k", [IntParam("n")], "", global_size=(2, 3))
    assert k.launch_vals((7,)) == (7, 2, 3, 1)
    with pytest.raises(TypeError, match=r"takes 1 int vals \(a\), got 2"):
        SAXPY.launch_vals([1, 2], (4,))
    with pytest.raises(TypeError, match="val a must be an int, got True"):
        SAXPY.launch_vals([True], (4,))
    with pytest.raises(ValueError, match="does not fit in a 32-bit int"):
        SAXPY.launch_vals([2**31], (4,))


def test_check_buffers_matches_dtypes() -> None:
    SAXPY.check_buffers([dtypes.float32] * 3)
    with pytest.raises(TypeError, match=r"buffer 1 \(x\) must be float32, got float16"):
        SAXPY.check_buffers([dtypes.float32, dtypes.float16, dtypes.float32])
    with pytest.raises(TypeError, match="takes 3 buffers, got 2"):
        SAXPY.check_buffers([dtypes.float32] * 2)


# ---- typing: C's rules ----------------------------------------------------------------------------


def _decl_dtype(expr: str, params: Sequence[BufferParam | IntParam] = ()) -> DType:
    k = Kernel("k", [*params, f32("out", "w")], f"out[0] = {expr};")
    stmt = k.statements[0]
    assert isinstance(stmt, Store)
    return stmt.value.dtype


@pytest.mark.parametrize(
    ("expr", "dtype"),
    [
        ("1", dtypes.int32),
        ("2147483648", dtypes.int64),
        ("0xFFFFFFFF", dtypes.uint32),
        ("1u", dtypes.uint32),
        ("1ll", dtypes.int64),
        ("1ull", dtypes.uint64),
        ("1.5f", dtypes.float32),
        ("1.5", dtypes.float64),
        ("1 + 1u", dtypes.uint32),
        ("1ll + 1u", dtypes.int64),
        ("1u + 1ll", dtypes.int64),
        ("1ull + 1ll", dtypes.uint64),
        ("1 + 1.5f", dtypes.float32),
        ("1.5f + 1.5", dtypes.float64),
        ("1 < 2", dtypes.bool),
        ("!1", dtypes.bool),
        ("1u << 3ll", dtypes.uint32),
        ("true ? 1 : 2.0f", dtypes.float32),
        ("max(1, 2ll)", dtypes.int64),
        ("abs(-1)", dtypes.int32),
        ("sqrt(2.0f)", dtypes.float32),
        ("pow(2.0f, 2.0)", dtypes.float64),
        ("(int8)300", dtypes.int8),
    ],
)
def test_expression_types_follow_c(expr: str, dtype: DType) -> None:
    assert _decl_dtype(expr) == dtype


def test_small_and_16_bit_loads_promote() -> None:
    params = [
        BufferParam("h", dtypes.float16),
        BufferParam("c", dtypes.int8),
        BufferParam("u", dtypes.uint64),
    ]
    assert _decl_dtype("h[0]", params) == dtypes.float32
    assert _decl_dtype("c[0]", params) == dtypes.int32
    assert _decl_dtype("c[0] + u[0]", params) == dtypes.uint64


def test_compound_assignment_expands_to_a_load_and_a_store() -> None:
    k = Kernel("k", [f32("o", "rw")], "o[gidx0] *= 2.0f; float x = 1; x += 2;")
    store, decl = k.statements[0], k.statements[1]
    assert isinstance(store, Store) and store.value.op == "binary" and store.value.arg == "*"
    assert store.value.args[0].op == "load"
    assert isinstance(decl, Decl) and decl.dtype == dtypes.float32


def test_int_literal_suffixes_are_spelled_per_language() -> None:
    k = Kernel("k", [BufferParam("o", dtypes.uint64, "w")], "o[0] = 5ll + 0x10u + 7ULL;")
    assert "(5ll + 0x10u) + 7ull" in ClangRenderer().render(k)
    assert "(5l + 0x10u) + 7ul" in OpenCLRenderer().render(k)
    assert "(5ll + 0x10u) + 7ull" in CUDARenderer().render(k)


# ---- rendered source and the calling convention ---------------------------------------------------


def test_clang_signature_follows_the_cpu_convention() -> None:
    src = ClangRenderer().render(SAXPY)
    assert (
        "void saxpy(float* restrict out, const float* restrict x, const float* restrict y, const int a, "
        "const int gsz0, const int gsz1, const int gsz2, const int core_id, const int core_count) {"
    ) in src


def test_gpu_signatures_take_the_global_size() -> None:
    cl = OpenCLRenderer().render(SAXPY)
    assert "__kernel void saxpy(__global float* restrict out, __global const float* restrict x," in cl
    assert (
        cl.count("get_global_id(") == 3
        and "if (gidx0 >= gsz0 || gidx1 >= gsz1 || gidx2 >= gsz2) return;" in cl
    )
    cu = CUDARenderer().render(SAXPY)
    assert 'extern "C" __global__ void saxpy(float* __restrict__ out,' in cu
    assert "blockIdx.x * blockDim.x + threadIdx.x" in cu


def test_render_by_device_name() -> None:
    assert render(SAXPY, "cpu") == ClangRenderer().render(SAXPY)
    assert render(SAXPY, "OPENCL:1") == OpenCLRenderer().render(SAXPY)
    with pytest.raises(ValueError, match="no renderer for 'METAL'"):
        render(SAXPY, "METAL")


def test_cpu_threads_choice() -> None:
    assert cpu_threads((1 << 26,), 16) == 16
    assert cpu_threads((1 << 26,), 2) == 2
    assert cpu_threads((1000,), 16) == 1  # too little work to hand to threads
    assert cpu_threads((1 << 20, 3), 16) == 3  # the split dimension (gsz1) has 3 rows
    assert cpu_threads((64, 64, 64), 8, min_items_per_thread=1) == 8
    with pytest.raises(ValueError, match="must be positive"):
        cpu_threads((0,), 4)


# ---- running rendered kernels on the CPU ---------------------------------------------------------


def test_bf16_reference_knows_the_textbook_cases() -> None:
    cases = {
        1.0: 0x3F80,
        -0.0: 0x8000,
        float(np.uint32(0x3F808000).view(np.float32)): 0x3F80,  # halfway, even stays
        float(np.uint32(0x3F818000).view(np.float32)): 0x3F82,  # halfway, odd rounds up
        float(np.uint32(0x3F808001).view(np.float32)): 0x3F81,
        float(np.finfo(np.float32).max): 0x7F80,
        float("inf"): 0x7F80,
    }
    got = bf16_reference(np.array(list(cases), dtype=np.float32))
    assert [int(v) for v in got] == list(cases.values())


async def test_float16_and_bfloat16_stores_round_to_nearest_even() -> None:
    x = SPECIAL_F32
    n = x.size
    with np.errstate(over="ignore"):
        expect_h = x.astype(np.float16)
    _, h, b, back = await run_cpu(
        CONVERT,
        (n,),
        [x, np.zeros(n, np.float16), np.zeros(n, np.uint16), np.zeros(n, np.float32)],
    )
    assert h.view(np.uint16).tolist() == expect_h.view(np.uint16).tolist()
    assert b.tolist() == bf16_reference(x).tolist()
    finite = np.isfinite(h.astype(np.float32))
    assert back[finite].tolist() == h.astype(np.float32)[finite].tolist()


async def test_bfloat16_nan_stays_nan() -> None:
    x = np.array([np.nan, -np.nan, float(np.uint32(0x7F800001).view(np.float32))], dtype=np.float32)
    _, h, b, _ = await run_cpu(
        CONVERT, (3,), [x, np.zeros(3, np.float16), np.zeros(3, np.uint16), np.zeros(3, np.float32)]
    )
    assert np.isnan(h.astype(np.float32)).all()
    assert all((v & 0x7F80) == 0x7F80 and (v & 0x7F) != 0 for v in b.tolist())


def _every_dtype_expected(arrays: Sequence[NDArray], n: int) -> dict[str, NDArray]:
    expect = {}
    for i, dt in enumerate(ALL_DTYPES):
        a = arrays[2 * i]
        lo, hi = a[:n], a[1 : n + 1]
        if dt == dtypes.bool:
            e = lo | hi
        elif dt.is_int:  # C: promote to (at least) int, add with wraparound, truncate on store
            wide = np.uint64 if dt.is_unsigned else np.int64
            e = (lo.astype(wide) + hi.astype(wide)).astype(dt.fmt)
        elif dt == dtypes.bfloat16:
            e = bf16_reference(bf16_to_f32(lo) + bf16_to_f32(hi))
        elif dt == dtypes.float16:
            e = (lo.astype(np.float32) + hi.astype(np.float32)).astype(np.float16)
        else:
            e = lo + hi
        expect[dt.name] = np.concatenate([e, np.zeros(1, e.dtype)])
    return expect


async def test_every_dtype_loads_computes_and_stores_exactly() -> None:
    n = 257
    arrays = _every_dtype_inputs(n)
    outs = await run_cpu(EVERY_DTYPE, (n,), arrays)
    expected = _every_dtype_expected(arrays, n)
    for i, dt in enumerate(ALL_DTYPES):
        got, want = outs[2 * i + 1], expected[dt.name]
        assert got.tobytes() == want.tobytes(), f"{dt.name}: {got[:8]} != {want[:8]}"


async def test_matmul_with_a_loop_matches_numpy() -> None:
    rng = np.random.default_rng(1)
    m, k, n = 33, 17, 45
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    (c, _, _) = await run_cpu(MATMUL, (n, m), [np.zeros(m * n, np.float32), a.ravel(), b.ravel()], [k])
    np.testing.assert_allclose(c.reshape(m, n), a @ b, rtol=1e-5, atol=1e-5)


async def test_saxpy_matches_numpy() -> None:
    x = np.arange(1000, dtype=np.float32) / 7
    y = np.full(1000, 0.25, np.float32)
    (out, _, _) = await run_cpu(SAXPY, (1000,), [np.zeros(1000, np.float32), x, y], [3])
    np.testing.assert_allclose(out, 3 * x + y, rtol=1e-6)


def _grid_expect(g0: int, g1: int, g2: int) -> NDArray:
    z, y, x = np.meshgrid(np.arange(g2), np.arange(g1), np.arange(g0), indexing="ij")
    return (x + 100 * y + 10000 * z + 1).astype(np.int32).ravel()


@pytest.mark.parametrize("global_size", [(5, 7, 3), (13, 4), (37,), (1, 1, 9), (6, 1, 1)])
@pytest.mark.parametrize("core_count", [1, 2, 3, 8])
async def test_every_index_runs_exactly_once_for_any_core_count(
    global_size: tuple[int, ...], core_count: int
) -> None:
    g = (*global_size, 1, 1)[:3]
    total = g[0] * g[1] * g[2]
    (o,) = await run_cpu(GRID, global_size, [np.zeros(total, np.int32)], core_count=core_count)
    assert o.tolist() == _grid_expect(*g).tolist()


@pytest.mark.parametrize(("global_size", "split_dim"), [((4, 5, 9), 2), ((4, 9, 1), 1), ((9, 1, 1), 0)])
async def test_one_core_runs_only_its_chunk_of_the_outermost_dimension(
    global_size: tuple[int, int, int], split_dim: int
) -> None:
    g0, g1, g2 = global_size
    (o,) = await run_cpu(GRID, global_size, [np.zeros(g0 * g1 * g2, np.int32)], core_count=3, core_ids=[1])
    full = _grid_expect(g0, g1, g2).reshape(g2, g1, g0)
    n = global_size[split_dim]
    lo, hi = n * 1 // 3, n * 2 // 3
    expect = np.zeros_like(full)
    sl: list[slice] = [slice(None)] * 3
    sl[2 - split_dim] = slice(lo, hi)
    expect[tuple(sl)] = full[tuple(sl)]
    assert o.reshape(g2, g1, g0).tolist() == expect.tolist()


@pytest.mark.parametrize("core_id", [-1, 3, 99])
async def test_core_id_out_of_range_does_nothing(core_id: int) -> None:
    (o,) = await run_cpu(GRID, (8,), [np.zeros(8, np.int32)], core_count=3, core_ids=[core_id])
    assert o.tolist() == [0] * 8


def _integer_ops_reference(a: NDArray) -> tuple[NDArray, NDArray]:
    o, u = [], []
    for v in a.tolist():
        # C's % truncates toward zero: v % 3 == 0 exactly when |v| is a multiple of 3
        acc = v * 4294967296 if abs(v) % 3 == 0 else (-v if v < 0 else v >> 1)
        acc += min(v, 5) + max(v, -5) * 2 + abs(v - 10)
        acc ^= (v & 0xF0) | (v << 2)
        acc += 1000 if 3 < v <= 20 else -1000
        o.append(acc)
        u.append(((v & 0xFFFFFFFF) * 2654435761 & 0xFFFFFFFF) >> 7)
    return np.array(o, np.int64), np.array(u, np.uint32)


async def test_integer_control_flow_and_operators_match_c_semantics() -> None:
    a = np.arange(-40, 41, dtype=np.int32)
    o, u, _ = await run_cpu(
        INTEGER_OPS, (a.size,), [np.zeros(a.size, np.int64), np.zeros(a.size, np.uint32), a]
    )
    want_o, want_u = _integer_ops_reference(a)
    assert o.tolist() == want_o.tolist()
    assert u.tolist() == want_u.tolist()


def _math_reference(x: NDArray) -> tuple[NDArray, NDArray]:
    v = x.astype(np.float64)
    cols = [
        np.sqrt(np.abs(v)),
        np.exp(v / 4),
        np.log(np.abs(v) + 1),
        np.sin(v) + np.cos(v) + np.tanh(v),
        np.floor(v) + np.ceil(v) * 10 + np.trunc(v) * 100 + np.sign(v) * np.floor(np.abs(v) + 0.5) * 1000,
        np.abs(v) ** 1.5 + np.exp2(v / 8) + np.log2(np.abs(v) + 2),
        np.minimum(v, 0.5) + np.maximum(v, -0.5) + np.tan(v / 10),
        np.trunc(v),
    ]
    return np.stack(cols, axis=1).ravel(), np.sqrt(np.abs(v)) + np.exp(v / 4)


async def test_math_functions_match_numpy() -> None:
    x = np.linspace(-6.5, 6.5, 53).astype(np.float32)
    o, d, _ = await run_cpu(
        MATH, (x.size,), [np.zeros(x.size * 8, np.float32), np.zeros(x.size, np.float64), x]
    )
    want_o, want_d = _math_reference(x)
    np.testing.assert_allclose(o, want_o, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(d, want_d, rtol=1e-12)


@pytest.mark.parametrize("cc", ["clang", "gcc"])
def test_rendered_c_compiles_warning_free(cc: str, tmp_path: Path) -> None:
    if shutil.which(cc) is None:
        pytest.skip(f"{cc} is not installed")
    path = tmp_path / "all.c"  # every case in one unit: helpers are guarded against redefinition
    path.write_text("\n".join(ClangRenderer().render(k) for k in CASES_BY_NAME.values()))
    argv = [cc, "-std=c11", "-O1", "-Wall", "-Werror", "-c", str(path), "-o", str(tmp_path / "all.o")]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"{cc}:\n{result.stderr}"


# ---- dev.program(Kernel): rendered by the device, launched with the kernel's vals ----------------


async def _buffers(arrays: Sequence[NDArray], dts: Sequence[DType], device: str = "CPU") -> list[Buffer]:
    bufs = []
    for array, dt in zip(arrays, dts, strict=True):
        buf = await Buffer(device, array.size, dt).allocate()
        await buf.copyin(np.ascontiguousarray(array))
        bufs.append(buf)
    return bufs


async def test_program_from_a_kernel_takes_its_vals_and_a_global_size() -> None:
    dev = Device["CPU"]
    prog = await dev.program(SAXPY)
    assert prog.kernel is SAXPY and prog.name == "saxpy"
    x = np.arange(1000, dtype=np.float32)
    out, xb, yb = await _buffers([np.zeros(1000, np.float32), x, x * 2], [dtypes.float32] * 3)
    await prog(out, xb, yb, vals=(3,), global_size=(1000,))
    np.testing.assert_allclose(await out.numpy(), 3 * x + x * 2, rtol=1e-6)
    for b in (out, xb, yb):
        await b.free()


async def test_kernel_default_global_size_is_used() -> None:
    kernel = Kernel("iota", [BufferParam("o", dtypes.int32, "w")], "o[gidx0] = gidx0 * 3;", global_size=(50,))
    dev = Device["CPU"]
    prog = await dev.program(kernel)
    (o,) = await _buffers([np.zeros(64, np.int32)], [dtypes.int32])
    await prog(o)
    assert (await o.numpy()).tolist() == [i * 3 for i in range(50)] + [0] * 14
    await o.free()


async def test_split_launch_over_many_threads_matches_the_grid(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPU_THREADS", "4")  # split even on a 1- or 2-core machine
    g = (128, 64, 9)  # 73728 indices: cpu_threads() gives 2 chunks of the outermost dimension
    async with open_device("CPU:7") as dev:
        assert cpu_threads(g, 4) == 2
        prog = await dev.program(GRID)
        (o,) = await _buffers([np.zeros(128 * 64 * 9, np.int32)], [dtypes.int32], "CPU:7")
        await prog(o, global_size=g)
        assert (await o.numpy()).tolist() == _grid_expect(*g).tolist()
        await o.free()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda p, b: p(*b[:3], vals=(1, 2), global_size=(8,)), TypeError, r"takes 1 int vals \(a\), got 2"),
        (lambda p, b: p(*b[:3], vals=(1,), global_size=(0,)), ValueError, "must be positive"),
        (lambda p, b: p(*b[:3], vals=(1,)), ValueError, "has no default global_size"),
        (lambda p, b: p(b[0], b[1], vals=(1,), global_size=(8,)), TypeError, "takes 3 buffers, got 2"),
        (
            lambda p, b: p(b[0], b[1], b[3], vals=(1,), global_size=(8,)),
            TypeError,
            r"buffer 2 \(y\) must be float32",
        ),
    ],
)
async def test_bad_kernel_launch_is_rejected_before_anything_is_enqueued(
    call: Callable[[Any, list[Buffer]], Any], error: type[Exception], match: str
) -> None:
    dev = Device["CPU"]
    prog = await dev.program(SAXPY)
    bufs = await _buffers(
        [np.zeros(8, np.float32)] * 3 + [np.zeros(8, np.int32)], [dtypes.float32] * 3 + [dtypes.int32]
    )
    submitted = [t.submitted for t in dev.timelines]
    with pytest.raises(error, match=match):
        call(prog, bufs)
    assert [t.submitted for t in dev.timelines] == submitted
    for b in bufs:
        await b.free()


async def test_program_of_a_bad_kernel_never_compiles() -> None:
    dev = Device["CPU"]
    before = dev.compiler.compiles
    with pytest.raises(KernelError, match="'nope' is not declared"):
        await dev.program(Kernel("bad2", [f32("o", "w")], "o[gidx0] = nope;"))
    assert dev.compiler.compiles == before


# ---- OpenCL: build and run on the machine's OpenCL platform (PoCL), compare with the CPU ---------

CL_HARNESS = r"""
#define CL_TARGET_OPENCL_VERSION 120
#include <CL/cl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* clh SRC NAME G0 G1 G2 [b:PATH | i:INT]...: build SRC on the first OpenCL device, then (NAME != -)
   run kernel NAME over the global size, buffers read from PATH and written back.
   Exit 0 ok, 2 build failed (log on stderr), 3 other error, 77 no OpenCL platform or device. */
static char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb"); if (!f) return NULL;
  fseek(f, 0, SEEK_END); long len = ftell(f); fseek(f, 0, SEEK_SET);
  char *buf = malloc(len + 1); *n = fread(buf, 1, len, f); buf[*n] = 0; fclose(f); return buf;
}
#define CHECK(x) do { cl_int e_ = (x); \
  if (e_ != CL_SUCCESS) { fprintf(stderr, "%s: %d\n", #x, e_); return 3; } } while (0)
int main(int argc, char **argv) {
  cl_platform_id platform; cl_device_id device; cl_uint n = 0; cl_int err;
  if (clGetPlatformIDs(1, &platform, &n) != CL_SUCCESS || n == 0) {
    fprintf(stderr, "no OpenCL platform\n"); return 77;
  }
  if (clGetDeviceIDs(platform, CL_DEVICE_TYPE_ALL, 1, &device, &n) != CL_SUCCESS || n == 0) {
    fprintf(stderr, "no OpenCL device\n"); return 77;
  }
  cl_context ctx = clCreateContext(NULL, 1, &device, NULL, NULL, &err); CHECK(err);
  size_t len; char *src = slurp(argv[1], &len); if (!src) { perror(argv[1]); return 3; }
  const char *srcs[] = {src};
  cl_program prog = clCreateProgramWithSource(ctx, 1, srcs, &len, &err); CHECK(err);
  cl_int built = clBuildProgram(prog, 1, &device, "-cl-std=CL1.2 -Werror", NULL, NULL);
  size_t loglen = 0; clGetProgramBuildInfo(prog, device, CL_PROGRAM_BUILD_LOG, 0, NULL, &loglen);
  char *log = malloc(loglen + 1);
  clGetProgramBuildInfo(prog, device, CL_PROGRAM_BUILD_LOG, loglen, log, NULL); log[loglen] = 0;
  if (built != CL_SUCCESS) { fprintf(stderr, "build failed (%d):\n%s\n", built, log); return 2; }
  if (argc < 6 || strcmp(argv[2], "-") == 0) return 0;
  cl_kernel k = clCreateKernel(prog, argv[2], &err); CHECK(err);
  size_t gsz[3] = {atoi(argv[3]), atoi(argv[4]), atoi(argv[5])};
  cl_command_queue q = clCreateCommandQueue(ctx, device, 0, &err); CHECK(err);
  cl_mem mems[128]; char *hosts[128]; size_t sizes[128]; int nb = 0;
  for (int a = 6; a < argc; a++) {
    if (argv[a][0] == 'b') {
      hosts[nb] = slurp(argv[a] + 2, &sizes[nb]);
      mems[nb] = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizes[nb], hosts[nb], &err);
      CHECK(err);
      CHECK(clSetKernelArg(k, a - 6, sizeof(cl_mem), &mems[nb])); nb++;
    } else { cl_int v = atoi(argv[a] + 2); CHECK(clSetKernelArg(k, a - 6, sizeof(cl_int), &v)); }
  }
  CHECK(clEnqueueNDRangeKernel(q, k, 3, NULL, gsz, NULL, 0, NULL, NULL));
  for (int b = 0, a = 6; a < argc; a++) {
    if (argv[a][0] != 'b') continue;
    CHECK(clEnqueueReadBuffer(q, mems[b], CL_TRUE, 0, sizes[b], hosts[b], 0, NULL, NULL));
    FILE *f = fopen(argv[a] + 2, "wb"); fwrite(hosts[b], 1, sizes[b], f); fclose(f); b++;
  }
  CHECK(clFinish(q));
  return 0;
}
"""


CASES_BY_NAME = {c.kernel.name: c.kernel for c in CASES}


@pytest.fixture(scope="module")
def opencl_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[NDArray]]:
    """Every case built as one OpenCL program and run on the first OpenCL device (PoCL here)."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to build the OpenCL test harness")
    tmp = tmp_path_factory.mktemp("opencl")
    (tmp / "clh.c").write_text(CL_HARNESS)
    argv = [cc, "-O1", str(tmp / "clh.c"), "-o", str(tmp / "clh"), "-lOpenCL"]
    build = subprocess.run(argv, capture_output=True, text=True, check=False)
    if build.returncode != 0:
        missing = "CL/cl.h" if "CL/cl.h" in build.stderr else "libOpenCL"
        pytest.skip(
            f"OpenCL headers or ICD loader missing ({missing}): "
            "apt-get install -y ocl-icd-opencl-dev pocl-opencl-icd"
        )
    env = {**os.environ, "POCL_CACHE_DIR": str(tmp / "pocl-cache")}
    source = tmp / "all.cl"
    source.write_text("\n".join(OpenCLRenderer().render(c.kernel) for c in CASES))
    first = subprocess.run(
        [str(tmp / "clh"), str(source), "-"], capture_output=True, text=True, env=env, check=False
    )
    if first.returncode == 77:
        pytest.skip(
            f"no OpenCL platform or device ({first.stderr.strip()}): apt-get install -y pocl-opencl-icd"
        )
    assert first.returncode == 0, f"the OpenCL program does not build:\n{first.stderr}"

    def run(case: Case) -> list[NDArray]:  # the build above is cached: each run only loads it
        work = tmp / case.kernel.name
        work.mkdir()
        inputs = case.make_inputs()
        args = []
        for i, array in enumerate(inputs):
            (work / f"b{i}").write_bytes(np.ascontiguousarray(array).tobytes())
            args.append(f"b:{work / f'b{i}'}")
        args += [f"i:{v}" for v in case.kernel.launch_vals(case.vals, case.global_size)]
        argv = [str(tmp / "clh"), str(source), case.kernel.name, *map(str, case.global_size), *args]
        result = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        assert result.returncode == 0, f"OpenCL {case.kernel.name} failed:\n{result.stderr}"
        return [np.fromfile(work / f"b{i}", dtype=a.dtype) for i, a in enumerate(inputs)]

    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return dict(zip([c.kernel.name for c in CASES], pool.map(run, CASES), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.kernel.name for c in CASES])
async def test_opencl_output_builds_and_matches_the_cpu(
    case: Case, opencl_results: dict[str, list[NDArray]]
) -> None:
    cpu = await run_cpu(case.kernel, case.global_size, case.make_inputs(), case.vals)
    cl = opencl_results[case.kernel.name]
    for i, (got, want) in enumerate(zip(cl, cpu, strict=True)):
        if case.exact:
            assert got.tobytes() == want.tobytes(), f"buffer {i}: {got[:6]} != {want[:6]}"
        else:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5, err_msg=f"buffer {i}")


# ---- the loaded object against a shared object ----------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=[c.kernel.name for c in CASES])
async def test_rendered_kernels_give_the_bytes_the_shared_object_gave(case: Case, tmp_path: Path) -> None:
    """Every case, run from the loaded relocatable object (the CPU device) and from a shared object
    built with the flags the device used before objects (cc -shared, dlopen): the same bytes."""
    got = await run_cpu(case.kernel, case.global_size, case.make_inputs(), case.vals)
    cc = find_cc()
    assert cc is not None
    src = ClangRenderer().render(case.kernel)
    so = tmp_path / "k.so"
    (tmp_path / "k.c").write_text(src)
    flags = ["-O2", "-march=native", "-fPIC", "-shared", "-fno-math-errno"]
    subprocess.run([*cc, *flags, "-x", "c", str(tmp_path / "k.c"), "-o", str(so), "-lm"], check=True)
    arrays = [np.ascontiguousarray(a) for a in case.make_inputs()]
    launch = case.kernel.launch_vals(case.vals, case.global_size)
    params = ", ".join(["void *"] * len(arrays) + ["int"] * (len(launch) + 2))
    ffi = cffi.FFI()
    ffi.cdef(f"void {case.kernel.name}({params});")
    fn = getattr(ffi.dlopen(str(so)), case.kernel.name)
    fn(*[ffi.from_buffer(a) for a in arrays], *launch, 0, 1)
    for i, (a, b) in enumerate(zip(got, arrays, strict=True)):
        assert a.tobytes() == b.tobytes(), f"buffer {i}: {a[:6]} != {b[:6]}"


# ---- CUDA: compile every case with nvcc ------------------------------------------------------------


@pytest.fixture(scope="module")
def cuda_ptx(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Every case rendered for CUDA into one translation unit, compiled to PTX by nvcc."""
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None
    )
    if nvcc is None:
        pytest.skip("nvcc is not installed (CUDA toolkit missing)")
    tmp = tmp_path_factory.mktemp("cuda")
    source = tmp / "all.cu"
    source.write_text("\n".join(CUDARenderer().render(k) for k in CASES_BY_NAME.values()))
    argv = [nvcc, "--ptx", "-Werror", "all-warnings", str(source), "-o", str(tmp / "all.ptx")]
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert result.returncode == 0, f"nvcc failed:\n{result.stderr}"
    return (tmp / "all.ptx").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES_BY_NAME))
def test_cuda_output_compiles_with_nvcc(name: str, cuda_ptx: str) -> None:
    assert f".entry {name}(" in cuda_ptx


def test_module_docstring_states_the_cpu_convention() -> None:
    doc = sys.modules["aiotinyrt.kernel"].__doc__ or ""
    assert "int gsz0, int gsz1, int gsz2, int core_id, int core_count" in doc
