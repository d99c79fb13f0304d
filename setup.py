"""Builds the native host queue (aiotinyrt/native/*.c) as an extension module at install time.

Everything else about the package is in pyproject.toml. The extension is optional: where no C
compiler is found, installation goes on and the queue is built at first use if a compiler appears
later, or runs on the pure-Python worker (see aiotinyrt/native/__init__.py).
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from setuptools import Extension, setup

NATIVE = Path("aiotinyrt") / "native"
SOURCES = ("hostq.c", "clq.c", "clq_poll.c", "pyext.c", "replay.c", "clfast.c", "clpoll.c", "lock.c")
HEADERS = ("hostq.h", "hostq_internal.h", "pyext.h", "clq.h", "clq_internal.h")


def source_digest() -> str:
    """The same digest as aiotinyrt.native.source_digest(), from the files being built."""
    h = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        h.update(name.encode() + b"\0" + (NATIVE / name).read_bytes())
    return h.hexdigest()[:16]


ext_modules = []
if sys.platform.startswith("linux"):
    ext_modules.append(
        Extension(
            "aiotinyrt.native._hostq",
            sources=[str(NATIVE / f) for f in SOURCES],
            depends=[str(NATIVE / f) for f in HEADERS],
            define_macros=[("HQ_SOURCE_DIGEST", f'"{source_digest()}"')],
            extra_compile_args=["-O2", "-pthread", "-Wall", "-Wextra", "-Werror"],
            extra_link_args=["-pthread"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules)
