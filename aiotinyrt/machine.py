"""What this machine offers: one report per backend, as ``python -m aiotinyrt`` prints it.

Each backend is opened (``Device[name]``); one that does not open is reported with the exact
reason its constructor gave (the CPU device names the missing C compiler and how to install one).
One that opens is described by its components: compiler (command and version banner), renderer,
``count()``, its queues and whether each runs on the native C ring or the Python worker, and its
allocator's memory in use.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass, field

from aiotinyrt import native
from aiotinyrt.device import Compiled, Device
from aiotinyrt.helpers import format_bytes


@dataclass(frozen=True)
class BackendReport:
    """One backend as this machine sees it: ``error`` is None when it opened."""

    name: str
    error: str | None = None
    compiler: str = ""
    renderer: str = ""
    count: int = 0
    queues: list[str] = field(default_factory=list)
    memory: str = ""


def open_error(exc: BaseException) -> str:
    """A device's failure to open, as one line: the exception's own message, its type for context."""
    return f"{exc} ({type(exc).__name__})" if str(exc) else type(exc).__name__


def compiler_description(device: Compiled) -> str:
    """The compiler's class, command and the first line of its ``--version`` (CPU: clang or gcc)."""
    compiler = device.compiler
    cc: list[str] | None = getattr(compiler, "cc", None)
    if not cc:
        return type(compiler).__name__
    try:
        banner = subprocess.run(
            [*cc, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout.splitlines()
    except (OSError, subprocess.SubprocessError) as exc:
        banner = [f"--version failed: {exc}"]
    return f"{' '.join(cc)} ({banner[0].strip() if banner else 'no version banner'})"


def describe(device: Compiled) -> BackendReport:
    """The report of an opened device."""
    stats = device.allocator.statistics()
    renderer = device.renderer
    queues = device.queues.values()
    return BackendReport(
        name=device.name,
        compiler=compiler_description(device),
        renderer=type(renderer).__name__ if renderer is not None else "none (raw source only)",
        count=device.count(),
        queues=[f"{q.name} ({'native C ring' if q.native else 'Python worker'})" for q in queues],
        memory=f"{format_bytes(stats.bytes_in_use)} in use, {format_bytes(stats.bytes_cached)} cached",
    )


def backend_reports() -> list[BackendReport]:
    """Open every backend found in ``aiotinyrt/backends`` and report on it."""
    native.load()  # the queue kinds below are those of a device opened now
    reports = []
    for backend in Device.backends:
        try:
            device = Device[backend]
        except Exception as exc:
            reports.append(BackendReport(name=backend, error=open_error(exc)))
            continue
        reports.append(describe(device))
    return reports


def format_reports(reports: list[BackendReport], version: str) -> str:
    """The reports as the table ``python -m aiotinyrt`` prints (``version``: the package's)."""
    lines = [
        f"aiotinyrt {version} on Python {sys.version.split()[0]} ({sys.platform})",
        f"native queue: {'built' if native.load() is not None else 'not available (Python workers)'}",
        "",
    ]
    for report in reports:
        if report.error is not None:
            lines.append(f"{report.name}: does not open: {report.error}")
            continue
        rows = [
            ("compiler", report.compiler),
            ("renderer", report.renderer),
            ("count()", str(report.count)),
            ("queues", ", ".join(report.queues)),
            ("memory", report.memory),
        ]
        lines.append(f"{report.name}: opens")
        lines.extend(f"  {key:<9} {value}" for key, value in rows)
    opened = [r.name for r in reports if r.error is None and r.name != "NULL"]
    if opened:
        lines += ["", f"default device: {Device.DEFAULT}"]
    else:
        lines += ["", "no device but NULL opens here: see the reasons above"]
    return "\n".join(lines)
