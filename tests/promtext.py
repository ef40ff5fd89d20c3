"""Reading a textfile gpuwarden wrote as Prometheus would: prometheus_client's own parser."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

Key = tuple[str, tuple[tuple[str, str], ...]]


def parse(text: str | Path) -> tuple[dict[Key, float], dict[str, str]]:
    """(every sample by (name, sorted labels), every family's type by the sample name a
    counter's or gauge's series has)."""
    if isinstance(text, Path):
        text = text.read_text()
    values: dict[Key, float] = {}
    kinds: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            assert key not in values, f"{key} twice"
            values[key] = s.value
            kinds[s.name] = fam.type
    return values, kinds


def value(text: str | Path, name: str, **labels: str) -> float | None:
    return parse(text)[0].get((name, tuple(sorted(labels.items()))))
