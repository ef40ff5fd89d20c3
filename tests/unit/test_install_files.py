"""`gpuwarden install-files PREFIX`: a site gets the hooks, plugins, checkpoint kit and systemd
units out of the installed package, rendered for this install, without any user able to steer
what root will run."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from gpuwarden.core import extras
from gpuwarden.install import plan, run
from gpuwarden.install.cli import install_files
from gpuwarden.install.plan import InstallError

REPO = Path(__file__).resolve().parents[2]
SITEFILES = REPO / "gpuwarden" / "sitefiles"
HOOK_LIB = SITEFILES / "prolog" / "gpuwarden-hook.sh"


def _install(tmp_path: Path, *args: str, prefix: Path | None = None) -> Result:
    prefix = prefix or tmp_path / "opt" / "gpuwarden"
    return CliRunner().invoke(install_files, [str(prefix), "--defaults-file",
                                              str(tmp_path / "etc" / "gpuwarden"), *args])


@pytest.fixture
def site(tmp_path: Path) -> Path:
    (tmp_path / "etc").mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    return tmp_path


def _this_gpuwarden() -> str:
    return run.this_install("/opt/gpuwarden").gpuwarden


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_ino, p.lstat().st_mtime_ns)
            for p in root.rglob("*")}


def test_every_site_file_lands_with_its_mode_and_this_installs_paths(site: Path) -> None:
    res = _install(site)
    assert res.exit_code == 0, res.output
    prefix = site / "opt" / "gpuwarden"
    for sf in plan.MANIFEST:
        got = prefix / sf.rel
        assert stat.S_IMODE(got.stat().st_mode) == sf.mode, sf.rel
        assert f"created {' ' * 15}{got} ({sf.mode:04o})" in res.output
        if sf.kind == "copy":
            assert got.read_bytes() == (SITEFILES / sf.rel).read_bytes()
    for d in ("prolog", "epilog", "plugins", "ckpt", "systemd", "prometheus", "grafana"):
        assert stat.S_IMODE((prefix / d).stat().st_mode) == 0o755
    # The monitoring files, as docs/monitoring.md loads them from PREFIX.
    assert (prefix / "prometheus" / "gpuwarden.rules.yml").read_text().startswith(
        "# gpuwarden's alerting rules for Prometheus")
    assert json.loads((prefix / "grafana" / "gpuwarden.json").read_text())["uid"] == "gpuwarden"
    unit = (prefix / "systemd" / "gpuwarden-placement.service").read_text()
    assert f"ExecStart={_this_gpuwarden()} placement daemon\n" in unit
    assert "/usr/local/bin" not in unit and plan.UNIT_PLACEHOLDER not in unit
    sbatch = (prefix / "ckpt" / "train.sbatch").read_text()
    assert f"\nGW_PYTHON={sys.executable}\n" in sbatch
    assert f"\nGW_KIT={prefix}/ckpt\n" in sbatch
    defaults = (site / "etc" / "gpuwarden").read_text()
    assert f"\nGPUWARDEN_PYTHON={sys.executable}\n" in defaults
    assert "next, in the order of docs/admin-guide.md:" in res.output
    assert "health selftest" in res.output


def test_the_shipped_hooks_find_their_library_and_this_interpreter(site: Path) -> None:
    """As slurmd runs them (/bin/sh, nothing in the environment), from PREFIX: the library
    beside the prolog, and the defaults file passes the hook's own checks."""
    assert _install(site).exit_code == 0
    prefix = site / "opt" / "gpuwarden"
    for hook in ("prolog/gpuwarden-prolog", "epilog/gpuwarden-epilog"):
        lib = f"{prefix / hook}".rsplit("/", 1)[0] + "/../prolog/gpuwarden-hook.sh"
        assert Path(lib).resolve() == prefix / "prolog" / "gpuwarden-hook.sh"
    code = (f'. {prefix}/prolog/gpuwarden-hook.sh; gw_python {site}/etc/gpuwarden /bin/false; '
            'printf %s "$_gw_py"')
    out = subprocess.run(["/bin/sh", "-c", code], env={}, capture_output=True, text=True,
                         timeout=30, check=True)
    assert out.stdout == sys.executable and out.stderr == ""


def test_a_second_run_changes_nothing(site: Path) -> None:
    assert _install(site).exit_code == 0
    before = _tree(site)
    res = _install(site)
    assert res.exit_code == 0, res.output
    assert _tree(site) == before
    assert "created" not in res.output and res.output.count("unchanged") == len(plan.MANIFEST) + 1


def test_an_edited_or_older_file_is_brought_back(site: Path) -> None:
    assert _install(site).exit_code == 0
    hook = site / "opt" / "gpuwarden" / "prolog" / "gpuwarden-prolog"
    hook.write_text("#!/bin/sh\nexit 0\n")
    hook.chmod(0o700)
    res = _install(site)
    assert f"updated {' ' * 15}{hook} (0755)" in res.output
    assert hook.read_bytes() == (SITEFILES / "prolog" / "gpuwarden-prolog").read_bytes()
    assert stat.S_IMODE(hook.stat().st_mode) == 0o755


def test_a_dry_run_lists_everything_and_writes_nothing(site: Path) -> None:
    res = _install(site, "--dry-run")
    assert res.exit_code == 0, res.output
    assert res.output.count("would create") == len(plan.MANIFEST) + 1
    assert not (site / "opt").exists() and not (site / "etc" / "gpuwarden").exists()
    assert "rerun without --dry-run" in res.output


@pytest.mark.parametrize("how", ["prefix", "subdir", "file"])
def test_links_are_refused_and_nothing_is_written(site: Path, how: str) -> None:
    elsewhere = site / "elsewhere"
    elsewhere.mkdir(mode=0o755)
    prefix = site / "opt" / "gpuwarden"
    if how == "prefix":
        (site / "opt").mkdir()
        prefix.symlink_to(elsewhere)
        if os.geteuid() == 0:  # a user's link (root's own, in root's directory, is followed)
            os.lchown(prefix, 65534, 65534)
    else:
        (prefix / "prolog").mkdir(parents=True)
        if how == "subdir":
            (prefix / "epilog").symlink_to(elsewhere)
        else:
            (prefix / "prolog" / "gpuwarden-prolog").symlink_to(elsewhere / "victim")
    before = _tree(site)
    res = _install(site)
    assert res.exit_code == 3
    assert "symbolic link" in res.output
    assert _tree(site) == before and list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("where", ["prefix", "parent"])
def test_a_directory_others_can_write_is_refused(site: Path, where: str) -> None:
    prefix = site / "opt" / "gpuwarden"
    prefix.mkdir(parents=True)
    target = prefix if where == "prefix" else prefix.parent
    target.chmod(0o775)
    res = _install(site)
    assert res.exit_code == 3
    assert f"{target} is writable by group or others: chmod go-w {target}" in res.output
    assert list(prefix.iterdir()) == []


def test_a_world_writable_sticky_parent_is_accepted(site: Path) -> None:
    """/tmp-like: others cannot rename what is ours in it."""
    (site / "opt").mkdir(mode=0o755)
    (site / "opt").chmod(0o1777)
    assert _install(site).exit_code == 0


def test_a_directory_owned_by_someone_else_is_refused(site: Path) -> None:
    """Who installs is injected: the directories here are then someone else's."""
    prefix = site / "opt" / "gpuwarden"
    (prefix / "prolog").mkdir(parents=True)
    target = plan.Target(str(prefix), sys.executable, _this_gpuwarden())
    req = run.Request(target, str(SITEFILES), None, owner=os.geteuid() + 4242)
    before = _tree(site)
    with pytest.raises(InstallError, match=r"is owned by uid \d+"):
        run.install(req)
    assert _tree(site) == before


@pytest.mark.parametrize("prefix", ["relative/dir", "/opt/with space", "/opt/$(id)", "/opt/../etc",
                                    "/"])
def test_a_path_scripts_and_units_would_misread_is_refused(site: Path, prefix: str) -> None:
    res = CliRunner().invoke(install_files, [prefix, "--no-defaults-file"])
    assert res.exit_code == 3
    assert "not a plain absolute path" in res.output


# ---- the defaults file the hooks read ---------------------------------------------------------
def test_a_different_interpreter_is_kept_until_replace_is_asked(site: Path) -> None:
    defaults = site / "etc" / "gpuwarden"
    defaults.write_text("GPUWARDEN_HOOK_LIMIT_S=200\nexport GPUWARDEN_PYTHON='/usr/bin/python3'\n")
    defaults.chmod(0o640)
    res = _install(site)
    assert res.exit_code == 3
    assert "GPUWARDEN_PYTHON=/usr/bin/python3, not this install's" in res.output
    assert "--replace-python" in res.output
    assert not (site / "opt").exists()  # refused before anything was written
    res = _install(site, "--replace-python")
    assert res.exit_code == 0, res.output
    assert defaults.read_text() == f"GPUWARDEN_HOOK_LIMIT_S=200\nGPUWARDEN_PYTHON={sys.executable}\n"
    assert stat.S_IMODE(defaults.stat().st_mode) == 0o640


def test_a_file_without_the_interpreter_gets_the_line_added(site: Path) -> None:
    defaults = site / "etc" / "gpuwarden"
    defaults.write_text("GPUWARDEN_HOOK_LIMIT_S=200")
    defaults.chmod(0o644)
    res = _install(site)
    assert "line added" in res.output
    assert defaults.read_text() == f"GPUWARDEN_HOOK_LIMIT_S=200\nGPUWARDEN_PYTHON={sys.executable}\n"


def test_a_defaults_file_the_hooks_would_ignore_is_refused(site: Path) -> None:
    defaults = site / "etc" / "gpuwarden"
    defaults.write_text(f"GPUWARDEN_PYTHON={sys.executable}\n")
    defaults.chmod(0o664)
    res = _install(site)
    assert res.exit_code == 3
    assert "so the hooks ignore it" in res.output and "chmod go-w" in res.output


def test_no_defaults_file_leaves_it_alone(site: Path) -> None:
    res = _install(site, "--no-defaults-file")
    assert res.exit_code == 0, res.output
    assert not (site / "etc" / "gpuwarden").exists()


@pytest.mark.parametrize("text", [
    'GPUWARDEN_PYTHON="/a/python"\n', "export GPUWARDEN_PYTHON='/a/python'\n",
    "GPUWARDEN_PYTHON=/b\n# x\nGPUWARDEN_PYTHON=/a/python", " GPUWARDEN_PYTHON=/b\n",
    "GPUWARDEN_PYTHON=\"/a/python\nGPUWARDEN_PYTHONX=/b\n", "nothing here\n"])
def test_the_defaults_file_is_read_as_the_hooks_read_it(tmp_path: Path, text: str) -> None:
    f = tmp_path / "defaults"
    f.write_text(text)
    f.chmod(0o644)
    code = f'. {HOOK_LIB}; gw_python {f} /bin/false; printf %s "$_gw_py"'
    shell = subprocess.run(["/bin/sh", "-c", code], env={}, capture_output=True, text=True,
                           timeout=30, check=True).stdout
    assert (plan.current_python(text.encode()) or "/usr/bin/python3") == shell


# ---- the files themselves --------------------------------------------------------------------
def test_the_manifest_names_every_shipped_file() -> None:
    shipped = {str(p.relative_to(SITEFILES)) for p in SITEFILES.rglob("*")
               if p.is_file() and "__pycache__" not in p.parts}
    assert shipped == {sf.rel for sf in plan.MANIFEST}
    for sf in plan.MANIFEST:  # what the repo's git tree says, too (a fresh clone)
        assert bool((SITEFILES / sf.rel).stat().st_mode & 0o111) == bool(sf.mode & 0o111), sf.rel


def test_the_repos_old_paths_are_relative_links_into_the_package() -> None:
    """The test cluster bind-mounts the repo at /opt/gpuwarden and runs
    /opt/gpuwarden/prolog/gpuwarden-prolog, which finds ${0%/*}/../prolog/gpuwarden-hook.sh."""
    for d in ("prolog", "epilog", "plugins", "ckpt"):
        link = REPO / d
        assert link.is_symlink() and os.readlink(link) == f"gpuwarden/sitefiles/{d}"
    assert (REPO / "epilog" / ".." / "prolog" / "gpuwarden-hook.sh").resolve() == HOOK_LIB


def test_the_sbatch_kit_builds_in_no_job_size() -> None:
    text = (SITEFILES / "ckpt" / "train.sbatch").read_text()
    assert "#SBATCH --nodes" not in text and "#SBATCH --gpus-per-node" not in text
    assert "#SBATCH -N" not in text


def test_a_missing_kit_stops_the_batch_script_with_what_to_do(site: Path) -> None:
    assert _install(site).exit_code == 0
    kit = site / "opt" / "gpuwarden" / "ckpt"
    (kit / "train_example.py").unlink()
    res = subprocess.run(["/bin/bash", str(kit / "train.sbatch")], env={"PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 2
    assert f"{kit}/train_example.py is missing" in res.stderr
    assert "install-files" in res.stderr


def test_every_extra_says_who_needs_it() -> None:
    assert set(run.NEEDED_ON) == set(extras.EXTRAS)


def test_a_missing_gpuwarden_command_says_which_to_run(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setattr(run.sysconfig, "get_path", lambda _name: str(tmp_path / "bin"))
    with pytest.raises(InstallError, match="no gpuwarden command beside"):
        run.this_install("/opt/gpuwarden")


def test_an_unwritable_prefix_says_to_run_as_root(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(_req: run.Request) -> run.Outcome:
        raise PermissionError(13, "Permission denied", "gpuwarden")

    monkeypatch.setattr(run, "install", denied)
    res = _install(site)
    assert res.exit_code == 1
    assert "Permission denied (gpuwarden); run it as root" in res.output
    assert "Traceback" not in res.output
