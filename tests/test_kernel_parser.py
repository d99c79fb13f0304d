"""The body language as read by pycparser: each rule the C grammar does not give by itself (the
hooks and the cleaning in aiotinyrt/kernel/parser.py), the per-process parse cache, and the
CPU renderer's output pinned byte for byte (compile-cache keys hash it)."""

from __future__ import annotations

import hashlib

import pytest

from aiotinyrt import dtypes
from aiotinyrt.kernel import BufferParam, ClangRenderer, Decl, If, IntParam, Kernel, KernelError, Store
from aiotinyrt.kernel import parser as kernel_parser

PARAMS = [BufferParam("out", dtypes.float32, "w"), BufferParam("a", dtypes.float32), IntParam("n")]


def build(body: str) -> Kernel:
    return Kernel("k", PARAMS, body)


@pytest.mark.parametrize(
    ("body", "error"),
    [
        # C drops parentheses from its tree; the language does not take them around a target
        ("(out[0]) = 1.0f;", r"column 1: expected a statement, found '\('"),
        ("(out)[0] = 1.0f;", r"column 1: expected a statement, found '\('"),
        ("float x = 1; (x)++;", r"column 14: expected a statement, found '\('"),
        ("for (int k = 0; k < n; (k)++) {}", r"column 24: expected a statement, found '\('"),
        ("out[0] = (sqrt)(1.0f);", r"column 11: 'sqrt' is not declared"),
        ("out[0] = (a)[0];", r"column 11: buffer 'a' must be indexed"),
        # the expected token is named, and the end of the body is not the wrapper's '}'
        ("out[0] = (1;", r"column 12: expected '\)', found ';'"),
        ("out[0] = n ? 1 2;", r"column 16: expected ':', found '2'"),
        ("out[0] = ;", "column 10: expected an expression, found ';'"),
        ("{{}", "column 4: expected '}', found the end of the body"),
        ("out[0] = 1.0f;\n}\nout[1] = 2.0f;", "line 2 column 1: expected a statement, found '}'"),
        # a statement starts with a name, '{', '++' or '--'
        (";", "column 1: expected a statement, found ';'"),
        ("if (n) ;", "column 8: expected a statement, found ';'"),
        ("-n;", "column 1: expected a statement, found '-'"),
        # characters pycparser would read as directives, strings or characters
        ("#line 5\nout[0] = 1.0f;", "line 1 column 1: unexpected character '#'"),
        ('out[0] = "s";', "column 10: unexpected character '\"'"),
        ("out[0] = 'a';", 'column 10: unexpected character "\'"'),
        ("out[0] = \u00e9;", "column 10: unexpected character 'é'"),
        # C accepts these; the language does not
        ("out[0] = 0b101;", "integer literal 0b101 is malformed"),
        ("out[0] = 1.0L;", "float literal 1.0L is malformed"),
        ("int x = 1, y = 2;", "expected ';', found ','"),
        ("out[0] = n, 1;", "column 11: expected ';', found ','"),
        ("out[0] = sizeof(n);", "'sizeof' is not part of the kernel body language"),
        ("unsigned int x = 1;", "a local variable's type must be one dtype name"),
        ("const int x = 1;", "'const' is not part of the kernel body language"),
        ("float x = 1; x = x = 2;", "'=' is a statement, not an expression"),
        ("case 1: out[0] = 1.0f;", "'case' is not part of the kernel body language"),
        ("int z = 0; z + 1;", "column 14: expected an assignment to 'z', found '\\+'"),
        ("a[0];", "column 5: expected an assignment to 'a', found ';'"),
        ("out[0] = a[0] % 2.0f;", "column 15: operator '%' needs integer operands"),
    ],
)
def test_rules_the_c_grammar_does_not_give(body: str, error: str) -> None:
    with pytest.raises(KernelError, match=error):
        build(body)


def test_a_declaration_may_be_the_body_of_if_else_and_for() -> None:
    k = build("if (n) float32 t = 1.0f; else int u = 2; for (int j = 0; j < n; j++) float x = 0.5f;")
    first = k.statements[0]
    assert isinstance(first, If)
    assert isinstance(first.then[0], Decl) and isinstance(first.orelse[0], Decl)
    with pytest.raises(KernelError, match="'t' is not declared"):  # scoped to its if
        build("if (n) float32 t = 1.0f; out[0] = t;")


def test_comments_and_any_whitespace_keep_positions() -> None:
    body = "/* a\n comment */ out[0] =\r\n\t1.0f; // x\f\nout[1] = a[0]\u00a0+ b;"
    with pytest.raises(KernelError, match=r"body line 4 column 17: 'b' is not declared"):
        build(body)
    k = build(body.replace("+ b", "+ 2.0f"))
    assert [type(s) for s in k.statements] == [Store, Store]


def test_c11_keywords_are_reserved_names() -> None:
    for name in ("_Atomic", "offsetof", "_Alignas"):
        with pytest.raises(KernelError, match="is reserved"):
            IntParam(name)


def test_a_kernel_built_twice_is_parsed_once() -> None:
    body = "out[gidx0] = a[gidx0] * n + 0.25f;"
    kernel_parser.parse_body.cache_clear()
    first = build(body)
    before = kernel_parser.parse_body.cache_info()
    second = build(body)
    after = kernel_parser.parse_body.cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses
    assert second.statements is first.statements
    with pytest.raises(KernelError):  # an error is not cached: it is raised again
        build("out[0] = nope;")
    with pytest.raises(KernelError):
        build("out[0] = nope;")


# sha256 of ClangRenderer output for these kernels, as rendered before the body language moved to
# pycparser: compile-cache keys hash the source, so a change here recompiles every user's kernels
CPU_SOURCE_SHA256 = {
    "saxpy": "bfbbcdb06c9466dd7c35829486ae663bce5b0ae59e52501a6202bb3284182af6",
    "matmul": "5f66c03434942acbb46ee704b6418f79f63b13229f0eef711edcd11a0f6f385e",
    "mixed": "3d6d45a8c8b98984c1c8e6209e3a88e5eab7c9d01d239553cd49f43822b8030a",
}


def _pinned_kernels() -> dict[str, Kernel]:
    f32 = dtypes.float32
    return {
        "saxpy": Kernel(
            "saxpy",
            [BufferParam("out", f32, "w"), BufferParam("x", f32), BufferParam("y", f32), IntParam("a")],
            "out[gidx0] = a * x[gidx0] + y[gidx0];",
        ),
        "matmul": Kernel(
            "matmul",
            [BufferParam("c", f32, "w"), BufferParam("a", f32), BufferParam("b", f32), IntParam("K")],
            "float32 acc = 0.0f;\nfor (int k = 0; k < K; k++) {\n"
            "  acc += a[gidx1 * K + k] * b[k * gsz0 + gidx0];\n}\nc[gidx1 * gsz0 + gidx0] = acc;",
        ),
        "mixed": Kernel(
            "mixed",
            [
                BufferParam("o", f32, "rw"),
                BufferParam("h", dtypes.float16, "rw"),
                BufferParam("b", dtypes.bfloat16, "w"),
                IntParam("n"),
            ],
            "o[gidx0] *= 2.0f; float x = 1; x += 2; x++; --x; if (n > 1) x = 3; else if (n < 0) { x -= 1; }\n"
            "{ int y = -n; o[gidx0] += (float32)(y % 3) + (x > 2 ? abs(y) : min(n, 2u)); }\n"
            "for (int k = 0; k < n; k += 2) o[k]--; h[gidx0] = sqrt(h[gidx0]) + pow(1.0, 2.0) + true;\n"
            "b[gidx0] = (int64)h[0] << 2 ^ 0x10u | 7ull & ~n;",
        ),
    }


@pytest.mark.parametrize("name", list(CPU_SOURCE_SHA256))
def test_cpu_source_is_unchanged_byte_for_byte(name: str) -> None:
    src = ClangRenderer().render(_pinned_kernels()[name])
    assert hashlib.sha256(src.encode()).hexdigest() == CPU_SOURCE_SHA256[name], src
