"""The shipped Slurm hooks fail open and loudly when Python or gpuwarden cannot run, and pass
on only the prolog's deliberate failure. Run as Slurm runs them: /bin/sh, no PATH."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.hooks import run as hooks
from tests.unit import pytrees

REPO = Path(__file__).resolve().parents[2]
LIB = REPO / "prolog" / "gpuwarden-hook.sh"
START = REPO / "prolog" / "gpuwarden_pystart.py"
SHIPPED = [REPO / "prolog" / "gpuwarden-prolog", REPO / "prolog" / "gpuwarden-healthcheck",
           REPO / "epilog" / "gpuwarden-epilog"]


class Node:
    """A node's hook setup in ROOT, which root alone may write (the hooks' rule refuses an
    interpreter under pytest's /tmp); stand-in interpreters go in ROOT/bin."""

    def __init__(self, root: Path) -> None:
        self.root = root
        (root / "bin").mkdir(mode=0o755, exist_ok=True)
        pytrees.fake_stdlib(root)
        self.defaults = root / "default-gpuwarden"
        self.start = START
        self.syslog = root / "syslog"
        self.logger = self.script("logger", f'printf "%s\\n" "$*" >> {self.syslog}\n')

    def script(self, name: str, body: str) -> Path:
        path = self.root / "bin" / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return path

    def python(self, path: Path | str) -> None:
        """Name ``path`` as the interpreter. A stand-in of script() is not named itself (the
        hooks refuse a script as the interpreter): a real interpreter of this tree's own is,
        and the file it starts in place of gpuwarden_pystart.py runs the stand-in's body, with
        the arguments the interpreter was given."""
        if Path(path).parent == self.root / "bin":
            self.start = self.root / "bin" / "standin_start.py"
            self.start.write_text("import os\nimport sys\nos.execv('/bin/sh', ['/bin/sh', "
                                  f"{str(path)!r}, '-I', '-S', *sys.argv])\n")
            if not (self.root / "base").exists():
                pytrees.base_python(self.root)
            path = self.root / "base" / "bin" / pytrees.VERSION
        self.defaults.write_text(f'# written at install\nGPUWARDEN_PYTHON="{path}"\n')
        self.defaults.chmod(0o644)

    def run(self, hook: str = "prolog") -> subprocess.CompletedProcess[str]:
        code = f'. {LIB}; gw_hook {hook} {self.defaults} {self.logger} {self.start}'
        return subprocess.run(["/bin/sh", "-c", code], env={}, capture_output=True, text=True,
                              timeout=60, check=False)

    def logged(self) -> str:
        return self.syslog.read_text() if self.syslog.exists() else ""


@pytest.fixture
def node() -> Iterator[Node]:
    with pytrees.root_only_dir() as d:
        yield Node(d)


def test_a_missing_interpreter_fails_open_and_loudly(node: Node) -> None:
    node.python(node.root / "venv" / "bin" / "python")
    res = node.run()
    assert res.returncode == 0
    assert "daemon.err" in node.logged() and "missing or not executable" in node.logged()
    assert "health gating is OFF" in res.stderr


def test_a_python_without_gpuwarden_fails_open_and_loudly(node: Node) -> None:
    """Reproduced: the shipped `#!/usr/bin/python3 -I` prolog on a site with gpuwarden in a
    venv died with ModuleNotFoundError; Slurm drained the node "Prolog error"."""
    # A real interpreter without gpuwarden: a base installation with an empty site-packages.
    bare = pytrees.base_python(node.root)
    node.python(bare)
    for hook in ("prolog", "epilog", "healthcheck"):
        res = node.run(hook)
        assert res.returncode == 0, res.stderr
        assert f"{hook}: {bare} cannot import gpuwarden" in node.logged()
        assert "ModuleNotFoundError" in node.logged()


@pytest.mark.parametrize(("status", "expected", "logged"), [
    (0, 0, ""),
    (hooks.EXIT_FAIL_JOB, 1, ""),  # the prolog drained the node: Slurm requeues the job
    (1, 0, "failed with exit status 1 (Fatal Python error: init_fs_encoding)"),
    (139, 0, "failed with exit status 139"),
])
def test_only_a_deliberate_failure_reaches_slurm(node: Node, status: int, expected: int,
                                                 logged: str) -> None:
    node.python(node.script("python3", "echo job output\necho 'Fatal Python error: "
                                       f"init_fs_encoding' >&2\nexit {status}\n"))
    res = node.run()
    assert res.returncode == expected
    assert "job output" in res.stdout and "Fatal Python error" in res.stderr
    assert (logged in node.logged()) if logged else node.logged() == ""


def test_a_python_that_hangs_is_stopped_at_the_hook_limit_and_fails_open(node: Node) -> None:
    """Python hung before gpuwarden's own deadlines exist (an import from a hung NFS mount)."""
    node.python(node.script("python3", "exec sleep 600\n"))
    with node.defaults.open("a") as f:
        f.write("GPUWARDEN_HOOK_LIMIT_S=1\n")
    res = node.run()
    assert res.returncode == 0
    assert "did not finish within 1 s and was stopped" in node.logged()


def test_a_defaults_file_others_can_write_is_ignored(node: Node) -> None:
    node.python(node.script("python3", "exit 0\n"))
    node.defaults.chmod(0o666)
    node.run()
    assert f"ignoring {node.defaults}" in node.logged()


def test_the_real_interpreter_runs_gpuwarden(node: Node, tmp_path: Path) -> None:
    node.python(sys.executable)
    res = subprocess.run(["/bin/sh", "-c", f". {LIB}; gw_hook nonsense {node.defaults} "
                          f"{node.logger} {START}"], env={}, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 0
    assert f"failed with exit status {hooks.EXIT_USAGE}" in node.logged()


def test_a_hook_copied_without_its_library_still_fails_open(tmp_path: Path) -> None:
    (tmp_path / "prolog").mkdir()
    copy = tmp_path / "prolog" / "gpuwarden-prolog"
    shutil.copy(SHIPPED[0], copy)
    res = subprocess.run([str(copy)], env={}, capture_output=True, text=True, timeout=30,
                         check=False)
    assert res.returncode == 0 and "is missing: health gating is OFF" in res.stderr


def test_the_shipped_hooks_are_sh_scripts_with_the_library_beside_them() -> None:
    for hook in SHIPPED:
        assert hook.read_text().startswith("#!/bin/sh\n") and os.access(hook, os.X_OK)
        assert subprocess.run(["/bin/sh", "-n", str(hook)], check=False).returncode == 0
    assert subprocess.run(["/bin/sh", "-n", str(LIB)], check=False).returncode == 0


@pytest.mark.parametrize(("hook", "cli_status", "expected"), [
    ("prolog", 1, hooks.EXIT_FAIL_JOB), ("prolog", 0, 0), ("prolog", 2, 2),
    ("epilog", 1, 1), ("healthcheck", None, 0),
])
def test_the_full_path_status_maps_onto_the_wrapper_protocol(
        monkeypatch: pytest.MonkeyPatch, hook: str, cli_status: int | None,
        expected: int) -> None:
    seen: list[list[str]] = []

    def cli_main() -> int:
        seen.append(list(sys.argv))
        raise SystemExit(cli_status)

    monkeypatch.setattr("gpuwarden.cli.main", cli_main)
    monkeypatch.setattr(sys, "argv", ["pytest"])
    assert hooks.full(hook) == expected
    assert seen == [["gpuwarden", "health", hooks.COMMANDS[hook]]]
