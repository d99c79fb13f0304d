"""Command line: ``python -m aiotinyrt [--version] [COMMAND]``.

With no command it prints a table of every backend (:mod:`aiotinyrt.machine`); ``demo`` runs
:mod:`aiotinyrt.demo`, ``devices`` lists the devices that open, ``trace FILE`` summarizes a
``PROFILE`` trace (:mod:`aiotinyrt.trace`). ``--help`` after any command describes its options.
"""

from __future__ import annotations

import argparse

import anyio

from aiotinyrt import __version__, demo, get_available_devices, machine, trace

_LOOPS = {
    "asyncio": ("asyncio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
    "trio": ("trio", {}),
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m aiotinyrt`` (every subcommand and option with help)."""
    parser = argparse.ArgumentParser(
        prog="python -m aiotinyrt",
        description="aiotinyrt, an async/await-native device runtime. With no command: a table of "
        "every backend (whether it opens and why not, compiler, renderer, count(), queues, memory).",
    )
    parser.add_argument("--version", action="version", version=f"aiotinyrt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p_demo = sub.add_parser(
        "demo",
        help="compile and time a kernel, then serve the digits MLP over CPU and CPU:1",
        description="Compile and time a kernel on CPU, compare one and two devices beside the "
        "machine's parallel ceiling, then run the digits MLP as a CPU -> CPU:1 pipeline.",
    )
    p_demo.add_argument(
        "--loop",
        choices=list(_LOOPS),
        default="asyncio",
        help="event loop to run on (trio needs the trio extra, uvloop the uvloop package; default: asyncio)",
    )
    sub.add_parser("devices", help="list the devices that open here, one per line", description="")
    sub.add_parser(
        "info",
        help="the table of every backend (the same as no command)",
        description="Open every backend and print whether it opens (or the exact reason it does not), "
        "its compiler and version, renderer, count(), queues and their kind, and memory in use.",
    )
    p_trace = sub.add_parser(
        "trace",
        help="summarize a PROFILE trace: busy share per queue, top kernels, copy bandwidth, idle gaps",
        description="Read a Chrome-trace JSON written with PROFILE=1 (or PROFILE=path) and print a "
        "summary; --png also draws a timeline (needs matplotlib: pip install 'aiotinyrt[plot]').",
    )
    p_trace.add_argument("file", help="the trace file (aiotinyrt_profile.json for PROFILE=1)")
    p_trace.add_argument("--png", metavar="OUT", help="also draw the timeline into this PNG file")
    p_trace.add_argument("--top", type=int, default=10, help="how many kernels to list (default: 10)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    if args.command in (None, "info"):
        print(machine.format_reports(machine.backend_reports(), __version__))
        return 0
    if args.command == "devices":
        for name in get_available_devices():
            print(name)
        return 0
    if args.command == "trace":
        return trace.main(args.file, png=args.png, top=args.top)
    backend, options = _LOOPS[args.loop]
    status: int = anyio.run(demo.main, backend=backend, backend_options=options)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
