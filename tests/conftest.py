"""Shared test setup: fixture paths, and the rule that e2e tests fail instead of skipping in CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


@pytest.fixture
def fixture_text() -> object:
    def read(name: str) -> str:
        return (FIXTURES / name).read_text()

    return read
