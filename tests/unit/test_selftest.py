"""`gpuwarden health selftest`: what an admin runs on a node before enabling the hooks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.health.probe import healthy_fake
from gpuwarden.hooks import selftest as selftest_mod
from tests.fakes import FakeSlurm
from tests.unit.test_gate import fleet


def node_config(tmp: Path, scontrol: bool = True) -> Path:
    (tmp / "gpus.json").write_text(healthy_fake(8))
    (tmp / "kmsg").write_text("")
    bin_dir = tmp / "slurm-bin"
    bin_dir.mkdir(mode=0o755)
    if scontrol:
        (bin_dir / "scontrol").write_text("#!/bin/sh\n")
        (bin_dir / "scontrol").chmod(0o755)
    cfg = tmp / "gpuwarden.toml"
    cfg.write_text(
        f"[slurm]\nbin_dir = '{bin_dir}'\n"
        f"[health]\nstate_dir = '{tmp / 'state'}'\nprom_dir = '{tmp / 'prom'}'\n"
        f"gpu_probe = 'fake'\nfake_gpu_file = '{tmp / 'gpus.json'}'\nkernel_log = '{tmp / 'kmsg'}'\n"
        f"[health.expected]\nscratch_path = '{tmp}'\n"
        "[health.blast_radius]\nsettle_s = 0\n")
    return cfg


def selftest(cfg: Path, slurm: FakeSlurm, monkeypatch: pytest.MonkeyPatch) -> tuple[int, str]:
    monkeypatch.setenv("SLURMD_NODENAME", "c3")
    # The hooks' interpreter: this one (tests/unit/test_hook_python_rule.py has the refusals).
    defaults = cfg.parent / "default-gpuwarden"
    defaults.write_text(f"GPUWARDEN_PYTHON={sys.executable}\n")
    defaults.chmod(0o644)
    monkeypatch.setattr(selftest_mod, "DEFAULTS_FILE", str(defaults))
    ctx = Context(config_path=str(cfg), client_factory=lambda c: slurm)  # type: ignore[arg-type,return-value]
    res = CliRunner().invoke(cli, ["health", "selftest"], obj=ctx)
    return res.exit_code, res.stdout


def test_a_ready_node_passes_and_the_dry_run_changes_nothing(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    slurm = FakeSlurm({n.name: n for n in fleet()})
    before = dict(slurm.table)
    code, out = selftest(node_config(tmp_path), slurm, monkeypatch)
    assert code == 0, out
    for step in ("config", "imports", "slurm commands", "slurm answers", "state dir",
                 "kernel log", "gpu probe", "dry run periodic", "dry run prolog",
                 "dry run epilog", "hook interpreter"):
        assert f"OK   {step}:" in out
    assert slurm.table == before and slurm.log == []
    assert not (tmp_path / "state" / "verdict.json").exists()


def test_a_bad_gpu_shows_what_the_dry_run_would_do_and_does_not(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import json

    slurm = FakeSlurm({n.name: n for n in fleet()})
    cfg = node_config(tmp_path)
    doc = json.loads((tmp_path / "gpus.json").read_text())
    doc["gpus"][5]["ecc_uncorrected_volatile"] = 1
    (tmp_path / "gpus.json").write_text(json.dumps(doc))
    code, out = selftest(cfg, slurm, monkeypatch)
    assert code == 0, out
    drains = [ln for ln in out.splitlines() if "would do: drain c3:" in ln]
    assert drains and all("1 uncorrectable ECC errors on GPU 5 [health]" in ln for ln in drains)
    assert slurm.log == [] and "DRAIN" not in slurm.table["c3"].state


def test_slurm_not_found_fails_with_what_to_fix(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    slurm = FakeSlurm({n.name: n for n in fleet()})
    code, out = selftest(node_config(tmp_path, scontrol=False), slurm, monkeypatch)
    assert code == 1
    assert "FAIL slurm commands:" in out and "fix: set [slurm] bin_dir" in out
    assert "dry run" not in out


def test_a_missing_config_fails_first(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    code, out = selftest(tmp_path / "absent.toml", FakeSlurm({}), monkeypatch)
    assert code == 1 and "FAIL config:" in out and "file not found" in out
