"""`install-files` step by step: check everything first, then write; the same call is the dry
run. Nothing is written when any check refuses."""

from __future__ import annotations

import importlib.util
import os
import posixpath
import stat
import sys
import sysconfig
from dataclasses import dataclass

from gpuwarden.extras import EXTRAS
from gpuwarden.install import plan, safewrite
from gpuwarden.install.plan import InstallError, Target

# Who needs each extra (docs/admin-guide.md's table of roles).
NEEDED_ON: dict[str, str] = {
    "ckpt": "compute nodes: checkpoint jobs and the prolog's stage-in",
    "nvml": "compute nodes: the GPU checks (unless [health] gpu_probe = \"fake\")",
    "lemon": "the host running `lemon scan` and `fleet mttf`",
    "s3": "compute nodes, when [ckpt] s3_bucket is set",
}


@dataclass(frozen=True)
class Request:
    target: Target
    source_dir: str
    defaults_file: str | None  # None: leave the hooks' defaults file alone
    replace_python: bool = False
    dry_run: bool = False
    owner: int = 0  # who installs: the uid every directory written in must belong to


@dataclass(frozen=True)
class Step:
    path: str
    action: str  # create, update, keep; for the defaults file also add, replace
    mode: int
    detail: str = ""


def source_dir() -> str:
    """The installed package's sitefiles/ (in a source checkout: the tree's own)."""
    import gpuwarden  # noqa: PLC0415

    return os.path.join(os.path.dirname(os.path.abspath(gpuwarden.__file__)), "sitefiles")


def this_install(prefix: str) -> Target:
    """The running interpreter and the `gpuwarden` command installed beside it. Not resolved:
    a venv's python is a link out of the venv, and only the venv's path finds its packages."""
    python = sys.executable
    dirs = dict.fromkeys([sysconfig.get_path("scripts"), os.path.dirname(python)])
    for d in dirs:
        exe = os.path.join(d, "gpuwarden")
        if os.path.isfile(exe) and os.access(exe, os.X_OK):
            return Target(prefix.rstrip("/") or "/", python, exe)
    raise InstallError(f"no gpuwarden command beside {python} (looked in {', '.join(dirs)}): "
                       "run install-files with the gpuwarden of the install the hooks should "
                       "use (for example /opt/gpuwarden/venv/bin/gpuwarden)")


def extras() -> dict[str, bool]:
    """Which extras this interpreter has (their modules are found, not imported)."""
    return {name: all(importlib.util.find_spec(m) is not None for m in EXTRAS[name])
            for name in NEEDED_ON}


def _defaults_step(req: Request) -> tuple[Step, bytes | None]:
    path = req.defaults_file
    assert path is not None
    plan.check_plain_path("the defaults file", path)
    where, name = posixpath.split(path)
    with safewrite.opened_dir(where, req.owner, create=False) as fd:
        if fd is None:
            raise InstallError(f"{where} does not exist: create it (install -d -m 0755 {where}), "
                               "or pass --no-defaults-file")
        existing = safewrite.read_existing(fd, name, path)
    mode = 0o644
    if existing is not None:
        st = existing[1]
        # The hooks ignore a file that is not theirs alone: it would name no interpreter.
        if st.st_uid != req.owner or st.st_mode & 0o022:
            raise InstallError(f"{path} is owned by uid {st.st_uid} or writable by group or "
                               f"others, so the hooks ignore it: chown {req.owner} {path} && "
                               f"chmod go-w {path}, then rerun")
        mode = stat.S_IMODE(st.st_mode)
    change = plan.merge_defaults(path, None if existing is None else existing[0],
                                 req.target.python, req.replace_python)
    return Step(path, change.action, mode, f"{plan.PY_KEY}{req.target.python}"), change.data


def install(req: Request) -> list[Step]:
    """Check every file and directory, then (unless a dry run) write what differs."""
    sources = {sf.rel: safewrite.read_source(req.source_dir, sf.rel) for sf in plan.MANIFEST}
    outputs = plan.outputs(sources, req.target)
    steps: list[tuple[Step, bytes | None]] = []
    for out in outputs:
        path = f"{req.target.prefix}/{out.rel}"
        where, name = posixpath.split(path)
        with safewrite.opened_dir(where, req.owner, create=False) as fd:
            existing = safewrite.read_existing(fd, name, path)
        if safewrite.same(existing, out.data, out.mode, req.owner):
            steps.append((Step(path, "keep", out.mode), None))
        else:
            steps.append((Step(path, "create" if existing is None else "update", out.mode),
                          out.data))
    if req.defaults_file is not None:
        steps.append(_defaults_step(req))
    if not req.dry_run:
        for step, data in steps:
            if data is not None:
                where, name = posixpath.split(step.path)
                with safewrite.opened_dir(where, req.owner, create=True) as fd:
                    assert fd is not None
                    safewrite.write_at(fd, name, data, step.mode)
    return [step for step, _ in steps]
