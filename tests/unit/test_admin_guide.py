"""docs/admin-guide.md is what a site installs by: one set of slurm.conf lines, agreeing with
`gpuwarden slurm-conf --check`, given only after every file they name is in place."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from gpuwarden.slurmconf import check as slurmconfcheck

GUIDE = (Path(__file__).resolve().parents[2] / "docs" / "admin-guide.md").read_text()
_SETTING = re.compile(r"^(#?)([A-Z][A-Za-z]+)=(\S+)")


def _blocks() -> list[str]:
    return re.findall(r"^```[a-z]*\n(.*?)^```", GUIDE, flags=re.MULTILINE | re.DOTALL)


def _settings(block: str) -> list[tuple[str, str]]:
    return [(m[1] + m[2], m[3]) for line in block.splitlines() if (m := _SETTING.match(line))]


def _slurm_conf_blocks() -> list[str]:
    return [b for b in _blocks() if b.startswith("# slurm.conf")]


def test_the_guide_gives_one_slurm_conf_block_with_each_key_once() -> None:
    (block,) = _slurm_conf_blocks()
    keys = Counter(key.lstrip("#") for key, _ in _settings(block))
    assert keys and max(keys.values()) == 1, keys
    for key in ("Prolog", "Epilog", "HealthCheckProgram", "PrologEpilogTimeout",
                "SchedulerParameters", "TopologyPlugin", "JobSubmitPlugins", "JobRequeue"):
        assert key in keys


def test_the_guides_lines_are_what_the_check_asks_for() -> None:
    (block,) = _slurm_conf_blocks()
    wanted = set(_settings(slurmconfcheck.block()))
    assert set(_settings(block)) == wanted


def test_files_are_in_place_before_slurm_conf_names_them() -> None:
    install = GUIDE.index("gpuwarden install-files /opt/gpuwarden\n")
    plugin = GUIDE.index("ln -sfn /opt/gpuwarden/plugins/job_submit.lua /etc/slurm/job_submit.lua")
    selftest = GUIDE.index("gpuwarden health selftest\n")
    first_line = min(GUIDE.index(f"\n{key}=") for key in ("JobSubmitPlugins", "Prolog"))
    assert install < selftest < plugin < first_line
