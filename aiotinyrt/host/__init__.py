"""Host support shared by backends whose kernels are host code (``backends/ops_cpu.py`` is its
four components on top of it):

- :mod:`aiotinyrt.host.compiler`: ``ClangCompiler`` (C source to a relocatable object) and
  ``find_compiler``; :mod:`aiotinyrt.host.ccprocess`, the compiler process started ahead of time;
- :mod:`aiotinyrt.host.elf`: the loader for relocatable ELF objects, and
  :mod:`aiotinyrt.host.arena`, the executable arenas it loads them into;
- :mod:`aiotinyrt.host.cores`: the core pool that runs a launch split over cores;
- :mod:`aiotinyrt.host.memory`: libc copies, the native queue's ``memmove`` command, the unmapper;
- :mod:`aiotinyrt.host.graph`: a captured run of raw launches compiled into one C function.
"""

from __future__ import annotations

from aiotinyrt.host.arena import ArenaPool, default_pool, process_symbol
from aiotinyrt.host.elf import LoadedObject, load, parse

__all__ = ["ArenaPool", "LoadedObject", "default_pool", "load", "parse", "process_symbol"]
