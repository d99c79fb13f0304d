"""README.md's code, as a new user meets it: every Python block is a whole script that runs after
the first Quick-start command, and the Quick-start commands are the ones CI runs."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
TRIO_VARIANT = '# or anyio.run(main, backend="trio")'


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def quick_start() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, "Quick start has no bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def scripts() -> list[tuple[str, str]]:
    """(id, source) of every block, plus the trio variant a block's comment suggests."""
    out = []
    for i, block in enumerate(python_blocks()):
        out.append((f"block{i}", block))
        if TRIO_VARIANT in block:
            out.append(
                (
                    f"block{i}-trio",
                    block.replace("anyio.run(main)  " + TRIO_VARIANT, 'anyio.run(main, backend="trio")'),
                )
            )
    return out


def test_readme_has_the_blocks_this_file_runs() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 3
    assert sum(TRIO_VARIANT in b for b in blocks) == 1
    assert len(quick_start()) == 2, "Quick start stays two commands"


@pytest.mark.slow
@pytest.mark.parametrize(("name", "source"), scripts(), ids=[n for n, _ in scripts()])
def test_readme_block_runs_as_a_script(name: str, source: str, tmp_path: Path) -> None:
    script = tmp_path / f"{name}.py"
    script.write_text(source)
    if name.endswith("-trio"):
        assert 'backend="trio"' in source
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False, cwd=tmp_path
    )
    assert result.returncode == 0, f"{name}:\n{source}\n{result.stdout}{result.stderr}"


def installed_by_first_command(block: str = "") -> set[str]:
    """The distributions ``pip install ".[extras]"`` (Quick start, first command) installs directly,
    plus the extras a block names in a first line ``# needs: pip install -e ".[extra]"``."""
    first = quick_start()[0]
    match = re.match(r'pip install "?\.(?:\[([\w,]+)\])?"?\s', first)
    assert match is not None, first
    extras = match.group(1).split(",") if match.group(1) else []
    needs = re.match(r'# needs: pip install (?:-e )?"\.\[([\w,]+)\]"', block)
    extras += needs.group(1).split(",") if needs else []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    return {re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_every_block_imports_only_what_the_first_command_installs() -> None:
    assert {"numpy", "trio"} <= installed_by_first_command()  # Buffer.numpy() and the trio variant
    dists = packages_distributions()
    for block in python_blocks():
        allowed = installed_by_first_command(block)
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "aiotinyrt":
                    continue
                owners = {d.lower() for d in dists.get(top, [])}
                assert owners & allowed, (
                    f"README imports {top} ({owners}), not installed by {quick_start()[0]!r}"
                )


def test_ci_runs_the_second_quick_start_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    second = quick_start()[1]
    assert any(line.replace(" -q -e", " -e") == second for line in ci), (second, ci)
