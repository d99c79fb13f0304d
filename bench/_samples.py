"""Per-repetition samples shared by the benchmarks (medians over interleaved repetitions)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field


@dataclass
class Samples:
    """Per-repetition samples, keyed by measurement name."""

    values: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        self.values.setdefault(key, []).append(value)

    def median(self, key: str) -> float | None:
        vals = self.values.get(key)
        return statistics.median(vals) if vals else None

    def last(self, key: str) -> float:
        """The latest sample of ``key`` (it must have one)."""
        return self.values[key][-1]
