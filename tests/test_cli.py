"""``python -m aiotinyrt`` as a user meets it: run as a subprocess, its output read as text."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

import aiotinyrt
from aiotinyrt.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiotinyrt", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def no_compiler_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a machine without a C compiler: PATH holds no clang, gcc or cc."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "CC"}
    env["PATH"] = str(empty)
    return env


def test_no_arguments_prints_every_backend_and_what_it_has() -> None:
    result = run_cli()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    # the backends a fresh interpreter finds (this one also has the test suite's registered ones)
    for module in (ROOT / "aiotinyrt" / "backends").glob("ops_*.py"):
        assert f"{module.stem.removeprefix('ops_').upper()}: opens" in out, out
    cpu = out.split("CPU: opens", 1)[1].split("NULL:", 1)[0]
    for key in ("compiler", "renderer", "count()", "queues", "memory"):
        assert f"  {key}" in cpu, cpu
    assert "clang" in cpu or "gcc" in cpu, cpu  # the compiler and its version banner
    assert "version" in cpu, cpu
    assert f"count()   {os.cpu_count()}" in cpu
    assert "compute (" in cpu and "copy (" in cpu  # each queue with its kind
    assert "default device: CPU" in out


@pytest.mark.slow
def test_version() -> None:
    result = run_cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"aiotinyrt {aiotinyrt.__version__}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


@pytest.mark.slow
def test_every_subcommand_and_option_has_help() -> None:
    parser = build_parser()
    commands = _subcommands(parser)
    assert {"demo", "devices", "info"} <= set(commands)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            assert all(helps.get(name) for name in commands), helps
    for name, sub in commands.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
        result = run_cli(name, "--help")
        assert result.returncode == 0 and f"python -m aiotinyrt {name}" in result.stdout, result


def test_a_missing_compiler_is_named_with_how_to_install_one(tmp_path: Path) -> None:
    result = run_cli(env=no_compiler_env(tmp_path))
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("CPU:"))
    assert "does not open" in line and "needs a C compiler" in line, line
    assert "no clang, gcc or cc on PATH" in line and "apt-get install -y clang" in line, line
    assert "NULL: opens" in result.stdout


@pytest.mark.slow
def test_a_cc_that_is_not_there_is_named(tmp_path: Path) -> None:
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"))
    result = run_cli(env=env)
    line = next(line for line in result.stdout.splitlines() if line.startswith("CPU:"))
    assert f"CC='{tmp_path / 'no-such-cc'}' is not an executable on PATH" in line, line


def test_the_demo_says_why_cpu_does_not_open(tmp_path: Path) -> None:
    result = run_cli("demo", env=no_compiler_env(tmp_path))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert "CPU device, which does not open here" in result.stderr, result.stderr
    assert "needs a C compiler" in result.stderr and "apt-get install -y clang" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args", [["--loop", "nope"], ["frobnicate"]])
def test_bad_arguments_are_usage_errors(args: list[str]) -> None:
    result = run_cli(*(["demo", *args] if args[0].startswith("-") else args))
    assert result.returncode == 2 and "usage: python -m aiotinyrt" in result.stderr
