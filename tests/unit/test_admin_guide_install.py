"""docs/admin-guide.md's install steps work as written on a fresh Debian/Ubuntu host: the build
has pip, the offline wheel set has every extra, cron finds the command."""

from __future__ import annotations

import re
from pathlib import Path

from gpuwarden.core import extras

GUIDE = (Path(__file__).resolve().parents[2] / "docs" / "admin-guide.md").read_text()


def _blocks() -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", GUIDE, flags=re.MULTILINE | re.DOTALL)


def test_the_system_pythons_pip_is_installed_before_it_is_used() -> None:
    """Debian and Ubuntu's python3 has no pip module without python3-pip."""
    for block in _blocks():
        if "python3 -m pip" in block:
            assert "apt-get install python3-pip" in block.split("python3 -m pip")[0], block


def test_the_offline_wheel_set_has_every_extra() -> None:
    (line,) = [ln for b in _blocks() for ln in b.splitlines() if "pip wheel -w dist '.[" in ln]
    assert set(line.split("'.[")[1].split("]'")[0].split(",")) == set(extras.EXTRAS)


def test_cron_lines_name_the_command_by_its_path() -> None:
    """cron's PATH is /usr/bin:/bin: /usr/local/bin/gpuwarden is not found."""
    entry = re.compile(r"[0-9*/,-]+( \S+){4} root ")
    cron = [ln for b in _blocks() for ln in b.splitlines() if entry.match(ln)]
    assert cron
    for line in cron:
        assert line.split()[6].startswith("/opt/gpuwarden/venv/bin/"), line


def test_the_interpreter_named_is_the_one_pips_scripts_start() -> None:
    assert "`GPUWARDEN_PYTHON=/opt/gpuwarden/venv/bin/python3`" in GUIDE
    assert "GPUWARDEN_PYTHON=/opt/gpuwarden/venv/bin/python`" not in GUIDE
