"""The hooks' entry point under its old name, for a site that upgraded the wheel but not yet the
copied-out hooks: `gpuwarden_pystart.py` from before the layers (issue 35) imports
``gpuwarden.health.hooks.main``; without this the upgrade alone turned gating off on every node
until `gpuwarden install-files` ran again. The entry point itself is gpuwarden.hooks.run."""

from __future__ import annotations

from gpuwarden.hooks.run import main

__all__ = ["main"]
