"""scripts/host-deps.sh: what `make demo` and `make test` install on a fresh Debian/Ubuntu
machine, driven with stand-in commands (id, docker, apt-get, lua5.1) on PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "host-deps.sh"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def host(tmp_path: Path) -> Path:
    """A PATH with only the basics and the stubs: nothing of what the script installs."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        real = shutil.which(tool)
        assert real is not None
        (bin_dir / tool).symlink_to(real)
    _stub(bin_dir, "id", 'echo "${FAKE_UID:-0}"')
    _stub(bin_dir, "docker", 'exit "${FAKE_DOCKER:-0}"')
    _stub(bin_dir, "apt-get", f'echo "$*" >> {tmp_path}/apt.log')
    return tmp_path


def _run(host: Path, *needs: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(host / "bin" / "bash"), str(SCRIPT), *needs], capture_output=True, text=True,
        timeout=30, check=False, env={"PATH": str(host / "bin"), **env})


def _apt(host: Path) -> list[str]:
    log = host / "apt.log"
    return log.read_text().splitlines() if log.exists() else []


def test_as_root_it_installs_what_is_missing_and_says_why_in_one_line(host: Path) -> None:
    proc = _run(host, "debootstrap", "lua")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "host-deps: installing debootstrap lua5.1 lua-filesystem with apt-get (debootstrap "
        "builds the cluster image; the unit tests run plugins/job_submit.lua under Lua 5.1)\n")
    assert _apt(host) == ["update -qq", "install -y -qq debootstrap lua5.1 lua-filesystem"]


def test_not_root_it_fails_with_the_exact_command(host: Path) -> None:
    proc = _run(host, "debootstrap", "lua", FAKE_UID="1000")
    assert proc.returncode == 1
    assert proc.stderr.endswith(
        "run as root: sudo apt-get install -y debootstrap lua5.1 lua-filesystem\n")
    assert proc.stderr.count("\n") == 1
    assert _apt(host) == []


def test_without_apt_get_it_names_the_packages(host: Path) -> None:
    (host / "bin" / "apt-get").unlink()
    proc = _run(host, "lua")
    assert proc.returncode == 1
    assert proc.stderr.startswith("host-deps: missing lua5.1 lua-filesystem (")
    assert "install them with your package manager" in proc.stderr


def test_nothing_to_do_when_all_is_there(host: Path) -> None:
    _stub(host / "bin", "debootstrap", "exit 0")
    _stub(host / "bin", "lua5.1", "exit 0")  # `lua5.1 -e 'require "lfs"'` succeeds too
    proc = _run(host, "debootstrap", "lua")
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    assert _apt(host) == []


def test_lua_filesystem_alone_when_lua_is_there_without_it(host: Path) -> None:
    _stub(host / "bin", "lua5.1", 'case "$*" in *lfs*) exit 1;; esac')
    proc = _run(host, "lua")
    assert proc.returncode == 0, proc.stderr
    assert _apt(host)[-1] == "install -y -qq lua-filesystem"


def test_promtool_comes_without_prometheus_recommends_in_its_own_call(host: Path) -> None:
    """Debian's prometheus recommends node_exporter, a second daemon: only promtool is wanted."""
    proc = _run(host, "lua", "promtool")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "host-deps: installing lua5.1 lua-filesystem prometheus with apt-get (the unit tests run "
        "plugins/job_submit.lua under Lua 5.1; the unit tests check the alert rules and the "
        "dashboard with promtool)\n")
    assert _apt(host) == ["update -qq", "install -y -qq lua5.1 lua-filesystem",
                          "install -y -qq --no-install-recommends prometheus"]


def test_promtool_not_root_names_both_commands(host: Path) -> None:
    proc = _run(host, "lua", "promtool", FAKE_UID="1000")
    assert proc.returncode == 1
    assert proc.stderr.endswith(
        "run as root: sudo apt-get install -y lua5.1 lua-filesystem && sudo apt-get install -y "
        "--no-install-recommends prometheus\n")
    _stub(host / "bin", "promtool", "exit 0")
    assert _run(host, "promtool", FAKE_UID="1000").returncode == 0  # there: nothing to do


def test_debootstrap_is_not_needed_without_docker(host: Path) -> None:
    # Nothing could be built: `make demo` then says Docker is unreachable, e2e tests skip.
    proc = _run(host, "debootstrap", FAKE_DOCKER="1")
    assert (proc.returncode, proc.stdout) == (0, "")
    assert _apt(host) == []


def test_a_python_without_venv_gets_python3_venv_and_an_old_one_is_refused(
        host: Path) -> None:
    proc = _run(host, "venv", PYTHON=sys.executable)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "", "")
    old = host / "bin" / "python-old"
    old.write_text("#!/bin/sh\nexit 1\n")
    old.chmod(0o755)
    proc = _run(host, "venv", PYTHON=str(old))
    assert proc.returncode == 1 and "needs Python >= 3.11" in proc.stderr


def _make(tmp_path: Path, *args: str, pytest_status: int = 0) -> tuple[int, str, list[str]]:
    """`make ARGS` with the venv's python and docker stood in for: what ran, in order."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    bin_dir = tmp_path / "stubs"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "ran.log"
    _stub(bin_dir, "python", f'echo "python $*" >> {log}\n'
                             f'case "$*" in "-m pytest"*) '
                             f'[ -z "$GPUWARDEN_CLUSTER_NAME" ] || echo "  on $GPUWARDEN_SLURM '
                             f'$GPUWARDEN_CLUSTER_NAME" >> {log}; exit {pytest_status};; esac')
    _stub(bin_dir, "docker", f'echo "docker $*" >> {log}')
    _stub(bin_dir, "host-deps", f'echo "host-deps $*" >> {log}')
    stamp, base_stamp = tmp_path / "installed", tmp_path / "installed-base"
    for done in (base_stamp, stamp):  # the venv is up to date
        done.touch()
        os.utime(done, (2**31, 2**31))
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "MAKEFLAGS": ""}
    # The Makefile's own knobs, which a `make test E2E_WORKERS=5` running this test exports.
    for var in ("KEEP_CLUSTER", "E2E_WORKERS", "VERSIONS_WORKERS", "MORE_SLURM", "E2E_LOGS",
                "UNIT_WORKERS", "MAKEOVERRIDES", "MFLAGS", "GPUWARDEN_CLUSTER_NAME", "GPUWARDEN_SLURM"):
        env.pop(var, None)
    proc = subprocess.run(
        ["make", "--no-print-directory", f"PY={bin_dir}/python", f"STAMP={stamp}", f"BASE_STAMP={base_stamp}",
         f"HOST_DEPS={bin_dir}/host-deps", f"E2E_LOGS={tmp_path}/e2e-logs", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=False)
    ran = log.read_text().splitlines() if log.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, ran


def test_make_demo_installs_before_it_builds(tmp_path: Path) -> None:
    code, out, ran = _make(tmp_path, "demo")
    assert code == 0, out
    assert ran[0] == "host-deps debootstrap"
    assert ran[1].endswith("-m devcluster up")


def test_a_first_make_demo_installs_no_torch(tmp_path: Path) -> None:
    """PyPI's torch is about 3 GB; the demo runs nothing that imports it (the cluster's nodes
    have Debian's), so a first `make demo` leaves it out and `make test` adds it."""
    venv = tmp_path / "venv"
    env = {**os.environ, "MAKEFLAGS": ""}
    demo = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={venv}", "demo"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=True)
    assert "pip install --quiet -e '.[dev]'" in demo.stdout
    assert "torch" not in demo.stdout.replace("no torch", "")
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    assert not [d for d in dev if "torch" in d], dev  # not even through the dev extra
    test = subprocess.run(["make", "-n", "--no-print-directory", f"VENV={venv}", "unit"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60, env=env, check=True)
    assert "pip install --quiet -e '.[dev,test-torch]'" in test.stdout


def test_make_test_serial_removes_its_cluster_and_keeps_the_tests_status(tmp_path: Path) -> None:
    # E2E_WORKERS=1: the serial run exactly as it was before clusters ran side by side.
    code, out, ran = _make(tmp_path, "test", "E2E_WORKERS=1", pytest_status=3)
    assert code != 0 and "Error 3" in out, out
    assert "host-deps debootstrap lua chromium promtool" in ran
    i = ran.index("python -m pytest tests -q --durations=20")
    # Each release's image is built before the tests' timers start.
    assert ran[i - 3:i] == ["docker info", "python -m devcluster image",
                            "python -m devcluster image"], ran
    # Then the e2e tests marked versions on the other Slurm release, then the cleanup.
    assert ran[i + 1:] == ["python -m pytest tests/e2e -q -m versions --durations=10", "docker info",
                           "python -m devcluster down"]


def test_make_test_serial_with_keep_cluster_leaves_it(tmp_path: Path) -> None:
    code, out, ran = _make(tmp_path, "test", "E2E_WORKERS=1", "KEEP_CLUSTER=1")
    assert code == 0, out
    assert ran[-2:] == ["python -m pytest tests -q --durations=20",
                        "python -m pytest tests/e2e -q -m versions --durations=10"]
    assert "KEEP_CLUSTER=1: the test cluster is left running" in out


XDIST = "--dist loadfile --no-loadscope-reorder"


def _parallel(ran: list[str]) -> tuple[list[str], list[str]]:
    """The parallel run's lines: (the 24.11 session's, the versions session's with its env line)
    apart, since the two run at once and their lines interleave."""
    i = ran.index("python -m pytest tests/unit tests/install -q -n 2 --durations=10")
    rest = ran[i + 1:]
    v = next(j for j, line in enumerate(rest) if "-m versions" in line)
    versions = rest[v:v + 2]
    return [ran[i], *rest[:v], *rest[v + 2:]], versions


def test_the_parallel_run_drops_no_test_directory(tmp_path: Path) -> None:
    """Every directory of tests runs in `make test` (the base install's once fell out when
    the e2e tests went side by side)."""
    code, _, ran = _make(tmp_path, "test")
    assert code == 0
    dirs = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("test_*.py")}
    run = " ".join(line for line in ran if "-m pytest" in line).split()
    assert dirs and all(d in run for d in dirs), (sorted(dirs), ran)


def test_make_test_runs_the_e2e_tests_on_clusters_side_by_side_and_removes_them(
        tmp_path: Path) -> None:
    code, out, ran = _make(tmp_path, "test", pytest_status=3)
    assert code != 0 and "Error 3" in out, out
    main, versions = _parallel(ran)
    assert main == ["python -m pytest tests/unit tests/install -q -n 2 --durations=10",
                    f"python -m pytest tests/e2e -q -n 4 {XDIST} --durations=20",
                    "docker info", "python -m devcluster down --workers"], ran
    # The other release's versions tests at the same time, on clusters of their own.
    assert versions == [
        f"python -m pytest tests/e2e -q -m versions -n 2 {XDIST} --durations=10",
        "  on 26.05 gwv"], ran
    # It says which phase it is in.
    for phase in ("make test: unit tests", "make test: e2e tests on 4 clusters side by side",
                  "versions, on Slurm 26.05 (clusters gwv<n>)", "removing the test clusters"):
        assert phase in out, out


def test_make_test_parallel_with_keep_cluster_and_more_workers(tmp_path: Path) -> None:
    code, out, ran = _make(tmp_path, "test", "KEEP_CLUSTER=1", "E2E_WORKERS=6",
                           "VERSIONS_WORKERS=2", "MORE_SLURM=26.05 26.05")
    assert code == 0, out
    assert ran[-1].startswith("python -m pytest") or ran[-1].startswith("  on"), ran
    assert "python -m devcluster down --workers" not in ran
    assert f"python -m pytest tests/e2e -q -n 6 {XDIST} --durations=20" in ran
    # Each release its own cluster names.
    assert sorted(line for line in ran if line.startswith("  on")) == [
        "  on 26.05 gwv", "  on 26.05 gww"], ran
    assert "KEEP_CLUSTER=1: the test clusters are left running" in out


def test_make_cluster_down_removes_the_parallel_runs_clusters_too(tmp_path: Path) -> None:
    code, out, ran = _make(tmp_path, "cluster-down")
    assert code == 0, out
    assert ran == ["python -m devcluster down",
                   "python -m devcluster down --workers"]
