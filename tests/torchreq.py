"""torch for the tests that need it: skipped with the reason where it is not installed, a
failure under CI=true (CI installs it: see the Makefile's venv target)."""

from __future__ import annotations

import pytest

from tests.conftest import in_ci

try:
    import torch
except ImportError as exc:
    if in_ci():
        raise ImportError(f"CI=true and torch cannot be imported: {exc}") from exc
    pytest.skip(f"torch is not installed ({exc}); pip install torch", allow_module_level=True)

__all__ = ["torch"]
