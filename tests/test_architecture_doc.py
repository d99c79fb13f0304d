"""docs/architecture.md shows the whole TOY backend as the skeleton of a backend; the file the
conformance suite runs must be exactly that code."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_backend_skeleton_in_the_docs_is_the_tested_toy_backend() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    match = re.search(r"<!-- toy-backend -->\n```python\n(.*?)```\n<!-- /toy-backend -->", doc, re.S)
    assert match is not None, "the skeleton's code block is missing from docs/architecture.md"
    assert match.group(1) == (ROOT / "tests" / "toy_backend.py").read_text()
