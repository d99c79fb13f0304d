"""The C compiler of host-code backends: C source to a relocatable ELF object, by the system C
compiler (clang, or gcc), loaded by :mod:`aiotinyrt.host.elf` without a linker.

Compiles go to a compiler process started ahead of time (:mod:`aiotinyrt.host.ccprocess`).
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import tempfile

import anyio
import anyio.to_thread

from aiotinyrt.compiler import CompileError, Compiler, compile_timeout
from aiotinyrt.helpers import debug_level, find_cc, get_logger, getenv_str
from aiotinyrt.host import ccprocess

_log = get_logger("compiler")


class ClangCompiler(Compiler):
    """C source to a relocatable ELF object, by the system C compiler run as a subprocess (no
    linker: :mod:`aiotinyrt.host.elf` loads the object)."""

    #: ``-c``: no link step and no startup code; ``-fPIC`` so code and data reach each other
    #: PC-relative wherever the loader puts them; no unwind tables (nothing reads them). Not
    #: ``-ffreestanding``: it implies ``-fno-builtin``, which turns raw C's ``sqrtf``/``fabsf``
    #: into libm calls and stops such loops vectorizing (20x slower, see docs/architecture.md).
    FLAGS = (
        "-c",
        "-O2",
        "-march=native",
        "-fPIC",
        "-fno-math-errno",
        "-fno-ident",
        "-fno-asynchronous-unwind-tables",
    )

    def __init__(self, cc: list[str]) -> None:
        super().__init__("compile_cpu_obj")  # the identity says "object": no shared object is ever loaded
        self.cc = cc
        self._process = ccprocess.for_argv([*cc, *self.FLAGS, "-x", "c", "-"])

    async def identity(self) -> str:
        """Compiler path, ``--version`` banner, flags, machine and CPU model.

        Cancellation: the ``--version`` process is killed; nothing is cached.
        """
        result = await anyio.run_process([*self.cc, "--version"], check=False)
        banner = result.stdout.decode(errors="replace").splitlines()[:1]
        cpu = await anyio.to_thread.run_sync(_cpu_model)
        return "|".join(["elf-relocatable", *self.cc, *banner, *self.FLAGS, platform.machine(), cpu])

    async def compile(self, src: str) -> bytes:
        """Compile C source to an object with ``cc -c -O2 -march=native -fPIC`` in a subprocess.

        Raises ``CompileError`` with the compiler's diagnostics on failure, when the compiler is
        killed, or after ``COMPILE_TIMEOUT_S`` seconds (default 120).

        Cancellation: the compiler process is killed.
        """
        if debug_level() >= 4:
            _log.debug("compiling:\n%s", src)
        limit = compile_timeout()
        result = await self._process.compile(src.encode(), limit)
        if result.timed_out:
            raise CompileError(f"{self.cc[0]} did not finish within {limit:g} s", src=src)
        if result.returncode != 0:
            how = (
                f"was killed by signal {-result.returncode}"
                if result.returncode < 0
                else f"exited with status {result.returncode}"
            )
            diagnostics = (result.stderr or result.output).decode(errors="replace")
            raise CompileError(f"{self.cc[0]} {how}", diagnostics, src)
        return result.output

    def disassemble(self, lib: bytes) -> str:
        """objdump -d of the object, relocations shown (blocking; call it from a thread in async code)."""
        objdump = shutil.which("objdump") or shutil.which("llvm-objdump")
        if objdump is None:
            raise RuntimeError("disassemble needs objdump (apt-get install -y binutils)")
        with tempfile.NamedTemporaryFile(suffix=".o") as f:
            f.write(lib)
            f.flush()
            return subprocess.run([objdump, "-dr", f.name], capture_output=True, text=True, check=True).stdout


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def find_compiler(who: str = "the CPU device") -> list[str]:
    """The C compiler command (:func:`aiotinyrt.helpers.find_cc`: ``$CC``, else clang, gcc or
    cc); raises ``RuntimeError`` naming what was looked for and how to install one."""
    cc = find_cc()
    if cc is None:
        env = getenv_str("CC")
        found = f"CC={env!r} is not an executable on PATH" if env else "no clang, gcc or cc on PATH"
        raise RuntimeError(
            f"{who} needs a C compiler and finds none ({found}): install clang "
            "(apt-get install -y clang) or gcc, or set CC to a C compiler"
        )
    return cc
