"""Host support shared by backends whose kernels are host code: a loader for relocatable ELF
objects (:mod:`aiotinyrt.host.elf`) and the executable arenas it loads them into
(:mod:`aiotinyrt.host.arena`)."""

from __future__ import annotations

from aiotinyrt.host.arena import ArenaPool, default_pool, process_symbol
from aiotinyrt.host.elf import LoadedObject, load, parse

__all__ = ["ArenaPool", "LoadedObject", "default_pool", "load", "parse", "process_symbol"]
