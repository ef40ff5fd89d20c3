"""The admin guide's marked blocks, as tests/e2e/test_admin_guide.py runs them, and the
slurm.conf merge it leaves to the admin."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from devcluster import guide
from gpuwarden.cli import cli
from gpuwarden.slurmconf import read as slurmconfread

ROOT = Path(__file__).resolve().parents[2]


def test_every_step_the_e2e_test_runs_is_marked_in_the_docs() -> None:
    steps = guide.blocks(ROOT / "docs" / "admin-guide.md")
    assert set(steps) == {"venv", "venv-admin", "install-files", "config", "selftest",
                          "ckpt-spool", "ckpt-config", "placement", "placement-without-systemd",
                          "slurm-conf-lines", "apply", "healthcheck-once"}
    assert set(guide.blocks(ROOT / "docs" / "testing-without-gpus.md")) == {
        "test-node-config", "test-node"}
    # The install step really is the offline Debian route the test nodes can take.
    assert any("--no-index" in c for c in steps["venv"].commands())
    assert any(c.startswith("systemctl ") for c in steps["placement"].commands())


def test_a_marker_without_its_block_is_an_error(tmp_path: Path) -> None:
    doc = tmp_path / "g.md"
    doc.write_text("<!-- e2e: x -->\ntext\n```\nls\n```\n")
    with pytest.raises(guide.GuideError, match="not right above"):
        guide.blocks(doc)
    doc.write_text("<!-- e2e: x -->\n```\nls\n")
    with pytest.raises(guide.GuideError, match="never closed"):
        guide.blocks(doc)
    doc.write_text("<!-- e2e: x -->\n```\nls\n```\n<!-- e2e: x -->\n```\nid\n```\n")
    with pytest.raises(guide.GuideError, match="twice"):
        guide.blocks(doc)


def test_commands_drop_comments_and_join_continuations() -> None:
    block = guide.Block("b", "# note\ninstall -m 0644 a \\\n    b /etc/\n\nls   # why\n", "x:1")
    assert block.commands() == ["install -m 0644 a      b /etc/", "ls   # why"]


def test_the_merge_combines_lists_keeps_the_sites_values_and_appends_the_rest(
        tmp_path: Path) -> None:
    site = ("ClusterName=site\nSchedulerParameters=bf_continue,Max_Switch_Wait=600\n"
            "ReturnToService=1\nGresTypes=gpu,mps\nPrologEpilogTimeout=900\n"
            "Prolog=/etc/slurm/prolog.d/*\nNodeName=gn[1-4] CPUs=16\n")
    lines = guide.Block("l", "GresTypes=gpu\n"
                             "SchedulerParameters=nohold_on_prolog_fail,max_switch_wait=3600\n"
                             "ReturnToService=2   # why\nPrologEpilogTimeout=300\n"
                             "Prolog=/opt/gpuwarden/prolog/gpuwarden-prolog\n"
                             "JobSubmitPlugins=lua\n#CliFilterPlugins=lua\n", "x:1")
    merged = guide.merge_slurm_conf(site, lines)
    # The site's option keeps its value (the check judges it); new options are added.
    assert "SchedulerParameters=bf_continue,Max_Switch_Wait=600,nohold_on_prolog_fail\n" in merged
    assert "GresTypes=gpu,mps\n" in merged and merged.count("GresTypes") == 1
    assert "ReturnToService=1\n" in merged and "PrologEpilogTimeout=900\n" in merged
    assert "ReturnToService=2" not in merged and "=300" not in merged
    # Both prologs run: gpuwarden's line goes beside the site's.
    assert "Prolog=/etc/slurm/prolog.d/*\n" in merged
    assert "Prolog=/opt/gpuwarden/prolog/gpuwarden-prolog\n" in merged
    assert merged.endswith("JobSubmitPlugins=lua\n") and "CliFilter" not in merged
    # Slurm's own reading of the result: one value per key, the merged one.
    path = tmp_path / "slurm.conf"
    path.write_text(merged)
    settings = slurmconfread.read(str(path))
    last = settings.last("schedulerparameters")
    assert last is not None and last.value.endswith(",nohold_on_prolog_fail")
    assert len(settings.all("prolog")) == 2


def test_a_sites_own_health_check_program_is_not_silently_replaced() -> None:
    lines = guide.Block("l", "HealthCheckProgram=/opt/gpuwarden/prolog/gpuwarden-healthcheck\n",
                        "x:1")
    with pytest.raises(guide.GuideError, match="Slurm runs one"):
        guide.merge_slurm_conf("HealthCheckProgram=/usr/sbin/nhc\n", lines)
    same = "HealthCheckProgram=/opt/gpuwarden/prolog/gpuwarden-healthcheck\n"
    assert guide.merge_slurm_conf(same, lines) == same


def test_the_guides_own_lines_merge_into_the_plain_sites_file() -> None:
    steps = guide.blocks(ROOT / "docs" / "admin-guide.md")
    site = (ROOT / "docker-cluster" / "site" / "slurm.conf").read_text()
    merged = guide.merge_slurm_conf(site, steps["slurm-conf-lines"])
    assert "SchedulerParameters=bf_continue,nohold_on_prolog_fail,max_switch_wait=3600" in merged
    assert "Prolog=/opt/gpuwarden/prolog/gpuwarden-prolog\n" in merged


def test_version_is_the_installed_distributions() -> None:
    res = CliRunner().invoke(cli, ["--version"])
    assert res.exit_code == 0
    assert res.output.startswith("gpuwarden 0.")
