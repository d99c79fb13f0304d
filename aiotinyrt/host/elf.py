"""A loader for relocatable ELF64 objects (``cc -c`` output) on x86-64 and AArch64.

:func:`parse` reads the object with :mod:`struct` (sections, symbols, RELA relocations);
:func:`plan` sizes the two blocks the object needs — *code* (text, read-only data, a GOT and
call stubs: read and execute) and *data* (``.data``, ``.bss``, common symbols: read and write);
:func:`link` lays the sections out at given addresses and applies the relocations; :func:`load`
does all of it into memory from :mod:`aiotinyrt.host.arena`.

External symbols (libm's ``expf``, libgcc's helpers, libc's ``memcpy``) are looked up in the
process. A call to one goes through a stub next to the code (``jmp *addr`` / ``ldr x16; br x16``)
and an address taken through the GOT, so the object itself never needs the symbol within
±2 GiB (x86-64 ``PC32``) or ±128 MiB (AArch64 ``CALL26``). Anything the loader does not handle
— another relocation type, thread-local storage, constructors, an unresolved symbol — is a
:class:`~aiotinyrt.compiler.CompileError` that names it.
"""

from __future__ import annotations

import platform
import struct
import weakref
from collections.abc import Callable
from typing import NamedTuple

from aiotinyrt.compiler import CompileError
from aiotinyrt.host import arena

EM_X86_64 = 62
EM_AARCH64 = 183
_MACHINES = {EM_X86_64: "x86-64", EM_AARCH64: "AArch64"}
_HOST_MACHINE = {"x86_64": EM_X86_64, "amd64": EM_X86_64, "aarch64": EM_AARCH64, "arm64": EM_AARCH64}

_SHT_PROGBITS, _SHT_SYMTAB, _SHT_RELA, _SHT_NOBITS, _SHT_REL = 1, 2, 4, 8, 9
_SHT_INIT_ARRAY, _SHT_FINI_ARRAY, _SHT_PREINIT_ARRAY = 14, 15, 16
_SHT_X86_64_UNWIND = 0x70000001
_SHF_WRITE, _SHF_ALLOC, _SHF_EXECINSTR, _SHF_TLS = 0x1, 0x2, 0x4, 0x400
_SHN_UNDEF, _SHN_ABS, _SHN_COMMON = 0, 0xFFF1, 0xFFF2
_STB_LOCAL, _STB_WEAK = 0, 2

#: The largest section (in practice: ``.bss``) the loader places.
MAX_SECTION_BYTES = 1 << 30
PAGE_ALIGN = 1 << 16  # the largest alignment of a common symbol
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
_RELA = struct.Struct("<QQq")

#: Relocation type names, for messages (the ones the loader applies, plus common others).
X86_64_RELOCS = {
    0: "R_X86_64_NONE", 1: "R_X86_64_64", 2: "R_X86_64_PC32", 3: "R_X86_64_GOT32", 4: "R_X86_64_PLT32",
    9: "R_X86_64_GOTPCREL", 10: "R_X86_64_32", 11: "R_X86_64_32S", 16: "R_X86_64_DTPMOD64",
    17: "R_X86_64_DTPOFF64", 18: "R_X86_64_TPOFF64", 19: "R_X86_64_TLSGD", 20: "R_X86_64_TLSLD",
    21: "R_X86_64_DTPOFF32", 22: "R_X86_64_GOTTPOFF", 23: "R_X86_64_TPOFF32", 24: "R_X86_64_PC64",
    25: "R_X86_64_GOTOFF64", 26: "R_X86_64_GOTPC32", 29: "R_X86_64_GOTPC64", 41: "R_X86_64_GOTPCRELX",
    42: "R_X86_64_REX_GOTPCRELX",
}  # fmt: skip
AARCH64_RELOCS = {
    0: "R_AARCH64_NONE", 256: "R_AARCH64_NONE", 257: "R_AARCH64_ABS64", 258: "R_AARCH64_ABS32",
    260: "R_AARCH64_PREL64", 261: "R_AARCH64_PREL32", 263: "R_AARCH64_MOVW_UABS_G0",
    264: "R_AARCH64_MOVW_UABS_G0_NC", 265: "R_AARCH64_MOVW_UABS_G1", 266: "R_AARCH64_MOVW_UABS_G1_NC",
    267: "R_AARCH64_MOVW_UABS_G2", 268: "R_AARCH64_MOVW_UABS_G2_NC", 269: "R_AARCH64_MOVW_UABS_G3",
    273: "R_AARCH64_LD_PREL_LO19", 274: "R_AARCH64_ADR_PREL_LO21", 275: "R_AARCH64_ADR_PREL_PG_HI21",
    276: "R_AARCH64_ADR_PREL_PG_HI21_NC", 277: "R_AARCH64_ADD_ABS_LO12_NC",
    278: "R_AARCH64_LDST8_ABS_LO12_NC", 279: "R_AARCH64_TSTBR14", 280: "R_AARCH64_CONDBR19",
    282: "R_AARCH64_JUMP26", 283: "R_AARCH64_CALL26", 284: "R_AARCH64_LDST16_ABS_LO12_NC",
    285: "R_AARCH64_LDST32_ABS_LO12_NC", 286: "R_AARCH64_LDST64_ABS_LO12_NC",
    299: "R_AARCH64_LDST128_ABS_LO12_NC", 311: "R_AARCH64_ADR_GOT_PAGE", 312: "R_AARCH64_LD64_GOT_LO12_NC",
    512: "R_AARCH64_TLSGD_ADR_PAGE21", 541: "R_AARCH64_TLSIE_ADR_GOTTPREL_PAGE21",
    549: "R_AARCH64_TLSLE_ADD_TPREL_HI12", 560: "R_AARCH64_TLSDESC_ADR_PAGE21",
}  # fmt: skip
_X86_GOT = frozenset((3, 9, 41, 42))  # GOT32 (as GOTPCREL's GOT-relative sibling), GOTPCREL(X)
_X86_CALL = frozenset((4,))  # PLT32
_A64_GOT = frozenset((311, 312))
_A64_CALL = frozenset((282, 283))
_X86_WIDE = frozenset((1, 24, 25, 29))  # relocations that write 8 bytes
_A64_WIDE = frozenset((257, 260))
_A64_LDST_SHIFT = {278: 0, 284: 1, 285: 2, 286: 3, 299: 4}
_STUB_SIZE = 16
_A64_STUB = struct.pack("<II", 0x58000050, 0xD61F0200)  # ldr x16, #8; br x16; then the address
_X86_STUB = b"\xff\x25\x00\x00\x00\x00"  # jmp *0(%rip); then the address


class LoadError(CompileError, ValueError):
    """A binary the loader refuses: a ``CompileError`` (the toolchain's output cannot run here)
    and a ``ValueError`` (bad input to ``Compiled.runtime``)."""


class Section(NamedTuple):
    """An allocated section of the object: where its bytes are and which block it goes to."""

    number: int  # the section header index
    name: str
    block: str  # "code" (text, read-only data) or "data" (writable data, bss)
    size: int
    align: int
    data: bytes | None  # None: NOBITS (zeros)


class Symbol(NamedTuple):
    """A symbol table entry (``shndx`` is the section index, or SHN_UNDEF/ABS/COMMON)."""

    name: str
    value: int
    size: int
    shndx: int
    bind: int
    kind: int


class ElfObject(NamedTuple):
    """A parsed relocatable object: machine, allocated sections, symbols and relocations
    (``(section index, offset, type, symbol index, addend)`` for every loaded section)."""

    machine: int
    sections: dict[int, Section]
    symbols: list[Symbol]
    relocations: list[tuple[int, int, int, int, int]]

    def reloc_name(self, rtype: int) -> str:
        """The name of relocation type ``rtype`` on this object's machine."""
        names = X86_64_RELOCS if self.machine == EM_X86_64 else AARCH64_RELOCS
        return names.get(rtype, f"{_MACHINES[self.machine]} relocation type {rtype}")


def _cstr(blob: bytes, offset: int) -> str:
    end = blob.find(b"\0", offset)
    return blob[offset : end if end >= 0 else len(blob)].decode(errors="replace")


def parse(blob: bytes) -> ElfObject:
    """Read a relocatable ELF64 little-endian object for x86-64 or AArch64.

    Raises ``CompileError`` for anything else (a shared object, a truncated file, TLS,
    constructors, REL relocations on a loaded section).
    """
    if blob[:4] != b"\x7fELF":
        raise CompileError("not an ELF object (no \\x7fELF magic)")
    try:
        return _parse(blob)
    except (struct.error, IndexError, ValueError) as exc:  # ValueError: a name that is not UTF-8
        raise CompileError(f"truncated or malformed ELF object ({exc})") from None


def _parse(blob: bytes) -> ElfObject:
    ident, e_type, machine, _, _, _, shoff, _, _, _, _, shentsize, shnum, shstrndx = _EHDR.unpack_from(blob)
    if ident[4] != 2 or ident[5] != 1:
        raise CompileError("not a 64-bit little-endian ELF object")
    if e_type != 1:
        what = {2: "an executable", 3: "a shared object"}.get(e_type, f"ELF type {e_type}")
        raise CompileError(f"not a relocatable object: {what} (compile with -c)")
    if machine not in _MACHINES:
        raise CompileError(f"unsupported ELF machine {machine} (x86-64 and AArch64 are)")
    if shentsize != _SHDR.size or shnum == 0 or shoff + shnum * _SHDR.size > len(blob):
        raise CompileError("malformed ELF section header table")
    headers = list(_SHDR.iter_unpack(blob[shoff : shoff + shnum * _SHDR.size]))
    shstr_off = headers[shstrndx][4]
    sections: dict[int, Section] = {}
    symtab: tuple[int, ...] | None = None
    relas: list[tuple[int, int, int, int]] = []  # (target, offset, size, index)
    for i, (name_off, stype, flags, _, offset, size, link, info, align, _) in enumerate(headers):
        if stype == _SHT_SYMTAB:
            symtab = (offset, size, link)
        elif stype == _SHT_RELA:
            relas.append((info, offset, size, i))
        elif stype == _SHT_REL and headers[info][2] & _SHF_ALLOC:
            raise CompileError(
                f"REL relocations (section {_cstr(blob, shstr_off + name_off)}) are not supported"
            )
        if not flags & _SHF_ALLOC or (stype == _SHT_X86_64_UNWIND and machine == EM_X86_64):
            continue
        name = _cstr(blob, shstr_off + name_off)
        if flags & _SHF_TLS:
            raise CompileError(f"thread-local storage (section {name}) is not supported")
        if stype in (_SHT_INIT_ARRAY, _SHT_FINI_ARRAY, _SHT_PREINIT_ARRAY):
            raise CompileError(f"constructors and destructors (section {name}) are not supported")
        if name == ".eh_frame" or stype not in (_SHT_PROGBITS, _SHT_NOBITS) or size == 0:
            continue  # unwind tables are not registered: nothing reads them
        if stype == _SHT_PROGBITS and offset + size > len(blob):
            raise CompileError(f"section {name} runs past the end of the object")
        if size > MAX_SECTION_BYTES or align > MAX_SECTION_BYTES:
            raise CompileError(f"section {name} is {size} bytes (at most {MAX_SECTION_BYTES} are loaded)")
        if align & (align - 1):
            raise CompileError(f"section {name} has an alignment ({align}) that is not a power of two")
        block = "data" if flags & _SHF_WRITE or stype == _SHT_NOBITS else "code"
        data = blob[offset : offset + size] if stype == _SHT_PROGBITS else None
        sections[i] = Section(i, name, block, size, max(align, 1), data)
    if symtab is None:
        raise CompileError("the object has no symbol table")
    sym_off, sym_size, str_index = symtab
    str_off, str_size = headers[str_index][4], headers[str_index][5]
    strtab = blob[str_off : str_off + str_size]
    find = strtab.find
    symbols = [
        Symbol(strtab[n : find(b"\0", n)].decode() if n else "", value, size, shndx, info >> 4, info & 0xF)
        for n, info, _, shndx, value, size in _SYM.iter_unpack(blob[sym_off : sym_off + sym_size])
    ]
    relocations: list[tuple[int, int, int, int, int]] = []
    for target, offset, size, _ in relas:
        if target not in sections:
            continue  # relocations of a section that is not loaded (.eh_frame, debug info)
        for r_offset, r_info, addend in _RELA.iter_unpack(blob[offset : offset + size]):
            relocations.append((target, r_offset, r_info & 0xFFFFFFFF, r_info >> 32, addend))
    if any(r[3] >= len(symbols) for r in relocations):
        raise CompileError("a relocation names a symbol the symbol table does not have")
    return ElfObject(machine, sections, symbols, relocations)


def _align(value: int, align: int) -> int:
    return (value + align - 1) & -align


class Layout(NamedTuple):
    """Where each section, GOT slot and stub goes, as offsets into the code and data blocks."""

    code_size: int
    data_size: int
    data_align: int
    offsets: dict[int, tuple[str, int]]  # section index -> (block, offset)
    commons: dict[int, int]  # symbol index of a common symbol -> offset in the data block
    got: dict[int, int]  # symbol index -> offset of its slot in the code block
    stubs: dict[int, int]  # symbol index of an external function -> offset of its stub


def plan(obj: ElfObject) -> Layout:
    """Lay out ``obj``: text then read-only data, then the GOT and the stubs in the code block;
    writable data, bss and common symbols in the data block."""
    offsets: dict[int, tuple[str, int]] = {}
    sizes = {"code": 0, "data": 0}
    data_align = 16
    ordered = sorted(
        obj.sections.values(), key=lambda s: (s.block, s.data is None, not s.name.startswith(".text"))
    )
    for section in ordered:
        at = _align(sizes[section.block], section.align)
        offsets[section.number] = (section.block, at)
        sizes[section.block] = at + section.size
        if section.block == "data":
            data_align = max(data_align, section.align)
    commons: dict[int, int] = {}
    for i, sym in enumerate(obj.symbols):
        if sym.shndx == _SHN_COMMON:  # st_value is the alignment
            if sym.size > MAX_SECTION_BYTES or not 0 < sym.value <= PAGE_ALIGN or sym.value & (sym.value - 1):
                raise CompileError(f"common symbol {sym.name!r} has size {sym.size}, alignment {sym.value}")
            at = _align(sizes["data"], max(sym.value, 1))
            commons[i] = at
            sizes["data"] = at + sym.size
            data_align = max(data_align, sym.value)
    got_kinds, call_kinds = (_X86_GOT, _X86_CALL) if obj.machine == EM_X86_64 else (_A64_GOT, _A64_CALL)
    got: dict[int, int] = {}
    stubs: dict[int, int] = {}
    for _, _, rtype, sym_index, _ in obj.relocations:
        if rtype in got_kinds:
            got.setdefault(sym_index, 0)
        elif rtype in call_kinds and obj.symbols[sym_index].shndx == _SHN_UNDEF:
            stubs.setdefault(sym_index, 0)
    at = _align(sizes["code"], 16)
    for sym_index in got:
        got[sym_index] = at
        at += 8
    for sym_index in stubs:
        stubs[sym_index] = at
        at += _STUB_SIZE
    if at > 2 * MAX_SECTION_BYTES or sizes["data"] > 2 * MAX_SECTION_BYTES:
        raise CompileError(f"the object needs {at} bytes of code and {sizes['data']} of data: too many")
    return Layout(at, sizes["data"], data_align, offsets, commons, got, stubs)


Resolver = Callable[[str], "int | None"]


def link(
    obj: ElfObject, layout: Layout, code_base: int, data_base: int, resolve: Resolver
) -> tuple[bytearray, bytearray, dict[str, int]]:
    """The code and data blocks' bytes for the given base addresses, relocated, and the
    addresses of the object's global symbols. ``resolve`` maps an external symbol's name to its
    address (None: unresolved, a ``CompileError`` unless the reference is weak)."""
    code = bytearray(layout.code_size)
    data = bytearray(layout.data_size)
    blocks = {"code": code, "data": data}
    bases = {"code": code_base, "data": data_base}
    for index, section in obj.sections.items():
        if section.data is not None:
            block, at = layout.offsets[index]
            blocks[block][at : at + section.size] = section.data
    got_base = code_base + min(layout.got.values(), default=layout.code_size)
    symbols = obj.symbols
    exports = {
        sym.name: _symbol_address(layout, i, sym, bases, resolve, got_base)
        for i, sym in enumerate(symbols)
        if sym.bind != _STB_LOCAL and sym.shndx != _SHN_UNDEF and sym.name and _placed(layout, sym)
    }
    addresses = {
        i: _symbol_address(layout, i, symbols[i], bases, resolve, got_base)
        for i in {r[3] for r in obj.relocations}
    }
    stub_code = _X86_STUB if obj.machine == EM_X86_64 else _A64_STUB
    for sym_index, at in layout.got.items():
        struct.pack_into("<Q", code, at, addresses[sym_index])
    stub_targets: dict[int, int] = {}
    for sym_index, at in layout.stubs.items():
        code[at : at + len(stub_code)] = stub_code
        struct.pack_into("<Q", code, at + len(stub_code), addresses[sym_index])
        stub_targets[sym_index] = code_base + at
    apply = _apply_x86_64 if obj.machine == EM_X86_64 else _apply_aarch64
    wide = _X86_WIDE if obj.machine == EM_X86_64 else _A64_WIDE
    for section_index, offset, rtype, sym_index, addend in obj.relocations:
        block, at = layout.offsets[section_index]
        if offset + (8 if rtype in wide else 4) > obj.sections[section_index].size:
            section = obj.sections[section_index]
            raise CompileError(f"relocation at {offset:#x} lies outside section {section.name}")
        where = at + offset
        place = bases[block] + where
        target = stub_targets.get(sym_index) or addresses[sym_index]
        slot = layout.got.get(sym_index)
        got_addr = None if slot is None else code_base + slot
        apply(obj, blocks[block], where, place, rtype, target, addend, got_addr, got_base, sym_index)
    return code, data, exports


def _placed(layout: Layout, sym: Symbol) -> bool:
    return sym.shndx in (_SHN_ABS, _SHN_COMMON) or sym.shndx in layout.offsets


def _symbol_address(
    layout: Layout, index: int, sym: Symbol, bases: dict[str, int], resolve: Resolver, got_base: int
) -> int:
    if sym.shndx == _SHN_UNDEF:
        if index == 0 or not sym.name:
            return 0
        if sym.name == "_GLOBAL_OFFSET_TABLE_":
            return got_base
        addr = resolve(sym.name)
        if addr is None:
            if sym.bind == _STB_WEAK:
                return 0
            raise CompileError(
                f"unresolved symbol {sym.name!r}: not defined in the kernel nor in the process"
            )
        return addr
    if sym.shndx == _SHN_ABS:
        return sym.value
    if sym.shndx == _SHN_COMMON:
        return bases["data"] + layout.commons[index]
    placed = layout.offsets.get(sym.shndx)
    if placed is None:
        raise CompileError(
            f"a relocation refers to {sym.name or 'a symbol'!r} in a section that is not loaded"
        )
    block, at = placed
    return bases[block] + at + sym.value


def _fits(value: int, bits: int, signed: bool) -> bool:
    return -(1 << (bits - 1)) <= value < (1 << (bits - 1)) if signed else 0 <= value < (1 << bits)


def _overflow(obj: ElfObject, rtype: int, sym_index: int, value: int) -> CompileError:
    name = obj.symbols[sym_index].name or f"symbol {sym_index}"
    return CompileError(f"relocation {obj.reloc_name(rtype)} against {name!r} overflows ({value:#x})")


def _needs(got_addr: int | None, obj: ElfObject, rtype: int) -> int:
    if got_addr is None:  # plan() gives every GOT relocation's symbol a slot
        raise CompileError(f"relocation {obj.reloc_name(rtype)} has no GOT slot")
    return got_addr


def _apply_x86_64(
    obj: ElfObject,
    buf: bytearray,
    where: int,
    place: int,
    rtype: int,
    target: int,
    addend: int,
    got_addr: int | None,
    got_base: int,
    sym_index: int,
) -> None:
    if rtype in (2, 4):  # PC32, PLT32 (a call to an external function goes to its stub)
        value, size, signed = target + addend - place, 4, True
    elif rtype in (9, 41, 42):  # GOTPCREL, GOTPCRELX, REX_GOTPCRELX: the slot is filled, no relaxing
        value, size, signed = _needs(got_addr, obj, rtype) + addend - place, 4, True
    elif rtype == 1:  # 64
        value, size, signed = target + addend, 8, False
    elif rtype == 24:  # PC64
        value, size, signed = target + addend - place, 8, True
    elif rtype == 10:  # 32
        value, size, signed = target + addend, 4, False
    elif rtype == 11:  # 32S
        value, size, signed = target + addend, 4, True
    elif rtype == 26:  # GOTPC32
        value, size, signed = got_base + addend - place, 4, True
    elif rtype == 29:  # GOTPC64
        value, size, signed = got_base + addend - place, 8, True
    elif rtype == 25:  # GOTOFF64
        value, size, signed = target + addend - got_base, 8, True
    elif rtype == 0:
        return
    else:
        raise CompileError(f"unsupported relocation {obj.reloc_name(rtype)} (against {_sym(obj, sym_index)})")
    if size == 8:
        struct.pack_into("<Q", buf, where, value & 0xFFFF_FFFF_FFFF_FFFF)
        return
    if not _fits(value, 32, signed):
        raise _overflow(obj, rtype, sym_index, value)
    struct.pack_into("<I", buf, where, value & 0xFFFF_FFFF)


def _sym(obj: ElfObject, sym_index: int) -> str:
    return repr(obj.symbols[sym_index].name or f"symbol {sym_index}")


def _page(addr: int) -> int:
    return addr & ~0xFFF


def _apply_aarch64(
    obj: ElfObject,
    buf: bytearray,
    where: int,
    place: int,
    rtype: int,
    target: int,
    addend: int,
    got_addr: int | None,
    got_base: int,
    sym_index: int,
) -> None:
    s_a = target + addend
    if rtype == 257:  # ABS64
        struct.pack_into("<Q", buf, where, s_a & 0xFFFF_FFFF_FFFF_FFFF)
        return
    if rtype == 260:  # PREL64
        struct.pack_into("<Q", buf, where, (s_a - place) & 0xFFFF_FFFF_FFFF_FFFF)
        return
    if rtype in (258, 261):  # ABS32, PREL32
        value = s_a if rtype == 258 else s_a - place
        if not (-(1 << 31) <= value < (1 << 32)):
            raise _overflow(obj, rtype, sym_index, value)
        struct.pack_into("<I", buf, where, value & 0xFFFF_FFFF)
        return
    if rtype in (0, 256):
        return
    (insn,) = struct.unpack_from("<I", buf, where)
    if rtype in (275, 276, 311):  # ADR_PREL_PG_HI21(_NC), ADR_GOT_PAGE: adrp
        dest = _needs(got_addr, obj, rtype) if rtype == 311 else s_a
        value = (_page(dest) - _page(place)) >> 12
        if rtype != 276 and not _fits(value, 21, True):
            raise _overflow(obj, rtype, sym_index, value)
        insn = (insn & 0x9F00001F) | ((value & 3) << 29) | (((value >> 2) & 0x7FFFF) << 5)
    elif rtype == 274:  # ADR_PREL_LO21: adr
        value = s_a - place
        if not _fits(value, 21, True):
            raise _overflow(obj, rtype, sym_index, value)
        insn = (insn & 0x9F00001F) | ((value & 3) << 29) | (((value >> 2) & 0x7FFFF) << 5)
    elif rtype == 277:  # ADD_ABS_LO12_NC
        insn = (insn & ~(0xFFF << 10)) | ((s_a & 0xFFF) << 10)
    elif rtype in _A64_LDST_SHIFT:  # LDSTn_ABS_LO12_NC: the offset scaled by the access size
        insn = (insn & ~(0xFFF << 10)) | (((s_a & 0xFFF) >> _A64_LDST_SHIFT[rtype]) << 10)
    elif rtype == 312:  # LD64_GOT_LO12_NC
        insn = (insn & ~(0xFFF << 10)) | (((_needs(got_addr, obj, rtype) & 0xFFF) >> 3) << 10)
    elif rtype in (282, 283):  # JUMP26, CALL26 (an external function: its stub)
        value = (s_a - place) >> 2
        if not _fits(value, 26, True):
            raise _overflow(obj, rtype, sym_index, value)
        insn = (insn & 0xFC000000) | (value & 0x3FFFFFF)
    elif rtype in (273, 280):  # LD_PREL_LO19, CONDBR19
        value = (s_a - place) >> 2
        if not _fits(value, 19, True):
            raise _overflow(obj, rtype, sym_index, value)
        insn = (insn & ~(0x7FFFF << 5)) | ((value & 0x7FFFF) << 5)
    elif rtype == 279:  # TSTBR14
        value = (s_a - place) >> 2
        if not _fits(value, 14, True):
            raise _overflow(obj, rtype, sym_index, value)
        insn = (insn & ~(0x3FFF << 5)) | ((value & 0x3FFF) << 5)
    elif 263 <= rtype <= 269:  # MOVW_UABS_G0..G3 (the large code model): 16 bits of S+A
        shift = 16 * ((rtype - 263) // 2)
        if rtype in (263, 265, 267) and not _fits(s_a >> shift, 16, False):
            raise _overflow(obj, rtype, sym_index, s_a)
        insn = (insn & ~(0xFFFF << 5)) | (((s_a >> shift) & 0xFFFF) << 5)
    else:
        raise CompileError(f"unsupported relocation {obj.reloc_name(rtype)} (against {_sym(obj, sym_index)})")
    struct.pack_into("<I", buf, where, insn & 0xFFFF_FFFF)


class LoadedObject:
    """An object loaded into an arena: its code (read and execute) and data (read and write).
    Its memory goes back to the arena when the LoadedObject is collected; whoever runs its code
    keeps it alive until the code has returned."""

    __slots__ = ("__weakref__", "allocation", "symbols")

    def __init__(self, allocation: arena.Allocation, symbols: dict[str, int]) -> None:
        self.allocation = allocation
        #: Global symbols defined by the object: name -> address.
        self.symbols = symbols

    def __repr__(self) -> str:
        a = self.allocation
        return f"<LoadedObject code 0x{a.code:x}+{a.code_size} data 0x{a.data:x}+{a.data_size}>"


def host_machine() -> int | None:
    """The ELF machine number of this process (None: not one the loader supports)."""
    return _HOST_MACHINE.get(platform.machine().lower())


def load(blob: bytes, resolve: Resolver | None = None, pool: arena.ArenaPool | None = None) -> LoadedObject:
    """Parse, lay out, relocate and place a relocatable object in executable memory.

    External symbols come from ``resolve`` (default: the process, see
    :func:`aiotinyrt.host.arena.process_symbol`). Raises ``CompileError`` for an object the
    loader cannot run here.
    """
    obj = parse(blob)
    if obj.machine != host_machine():
        raise CompileError(f"a {_MACHINES[obj.machine]} object cannot run on {platform.machine()}")
    layout = plan(obj)
    pool = pool or arena.default_pool()
    allocation = pool.allocate(layout.code_size, layout.data_size, layout.data_align)
    try:
        code, data, symbols = link(
            obj, layout, allocation.code, allocation.data, resolve or arena.process_symbol
        )
        pool.write(allocation, code, data)
    except BaseException:
        pool.release(allocation)
        raise
    loaded = LoadedObject(allocation, symbols)
    # not at exit: a worker may still be running this code while the interpreter finalizes
    weakref.finalize(loaded, pool.release, allocation).atexit = False
    return loaded
