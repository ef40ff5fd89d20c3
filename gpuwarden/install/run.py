"""`install-files` step by step: check everything first, then write; the same call is the dry
run. Nothing is written when any check refuses."""

from __future__ import annotations

import importlib.util
import os
import posixpath
import stat
import sys
import sysconfig
from dataclasses import dataclass, field

from gpuwarden.core import safefs
from gpuwarden.core.extras import EXTRAS
from gpuwarden.install import hookrule, plan, trust
from gpuwarden.install.plan import InstallError, Target

# Who needs each extra (docs/admin-guide.md's table of roles).
NEEDED_ON: dict[str, str] = {
    "ckpt": "compute nodes: checkpoint jobs and the prolog's stage-in",
    "nvml": "compute nodes: the GPU checks (unless [health] gpu_probe = \"fake\")",
    "lemon": "the host running `lemon scan` and `fleet mttf`",
    "s3": "compute nodes, when [ckpt] s3_bucket is set",
    "report": "the host running `gpuwarden report`",
    "store": "the host keeping the accounting store (`accounting ingest/sync`, `--store`)",
}
_NO_DEFAULTS = "or pass --no-defaults-file (a host that runs no Slurm hooks)"


def package_dir() -> str:
    """The directory of the gpuwarden package this process runs."""
    import gpuwarden  # noqa: PLC0415

    return os.path.dirname(os.path.abspath(gpuwarden.__file__))


@dataclass(frozen=True)
class Runtime:
    """The installed code the hooks and units will start as root, besides Target's interpreter
    and `gpuwarden` command."""

    prefix: str  # sys.prefix: the venv
    site_dirs: tuple[str, ...]  # its site-packages (gpuwarden's dependencies, .pth files)
    package: str  # gpuwarden itself (outside site_dirs in an editable install)


def this_runtime() -> Runtime:
    sites = dict.fromkeys(sysconfig.get_path(n) for n in ("purelib", "platlib"))
    return Runtime(sys.prefix, tuple(sites), package_dir())


@dataclass(frozen=True)
class Request:
    target: Target
    source_dir: str
    defaults_file: str | None  # None: leave the hooks' defaults file alone
    replace_python: bool = False
    dry_run: bool = False
    owner: int = 0  # who installs: the uid every directory written in must belong to
    runtime: Runtime = field(default_factory=this_runtime)


@dataclass(frozen=True)
class Step:
    path: str
    action: str  # create, update, keep; for the defaults file also add, replace
    mode: int
    detail: str = ""


def source_dir() -> str:
    """The installed package's sitefiles/ (in a source checkout: the tree's own)."""
    return os.path.join(package_dir(), "sitefiles")


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


# ---- what root will run, and what job users can reach ----------------------------------------
def _runtime_seen(req: Request) -> list[tuple[str, trust.Seen, bool]]:
    """(what it is, something on the way to it or in it, whether it is run) for this install."""
    rt, tg = req.runtime, req.target
    roots = [("the interpreter", tg.python, True), ("the gpuwarden command", tg.gpuwarden, True),
             ("the venv", rt.prefix, False),
             ("the directory of the interpreter", os.path.dirname(tg.python), False)]
    out = [(what, s, run) for what, path, run in roots for s in trust.reach(path)]
    # A missing site directory imports nothing (and its parent is checked on the way).
    for what, path in [*(("site-packages", d) for d in rt.site_dirs),
                       ("gpuwarden's package", rt.package)]:
        seen = trust.reach(path, missing_ok=True)
        out += [(what, s, False) for s in seen]
        if not seen[-1].on_way and stat.S_ISDIR(seen[-1].st.st_mode):
            out += [(what, s, False) for s in trust.tree(seen[-1].path)]
    return out


def check_runtime(req: Request) -> list[str]:
    """Refuse an install whose code someone other than root (or who installs) could change: the
    hooks would run it as root. Returns what job users cannot reach (warnings)."""
    try:
        seen = _runtime_seen(req)
    except OSError as exc:
        raise InstallError(f"cannot check this install ({exc.strerror}: {exc.filename}): "
                           "reinstall it, then rerun") from exc
    who = "root" if req.owner == 0 else f"root or uid {req.owner}"
    for what, s, _ in seen:
        problem = trust.control_problem(s, req.owner)
        if problem:
            raise InstallError(
                f"{problem} ({what} of this install, {req.target.python}); "
                f"the hooks and units would run it as root, so it must be {who}'s alone. "
                "Install gpuwarden into a venv only root can write (as root: python3 -m venv "
                "/opt/gpuwarden/venv, docs/admin-guide.md step 2) and run that venv's "
                "gpuwarden install-files, or chown and chmod go-w what is named here")
    _check_hook_rule(req)
    return _unreachable([(s, run) for _, s, run in seen])


def _check_hook_rule(req: Request) -> None:
    """The hooks' own rule on the interpreter (gpuwarden_pystart.py): what it imports when the
    hooks start it, the system's site directories of a --system-site-packages venv and the
    standard library included, as the hooks will check it on every start."""
    python = req.target.python
    found = hookrule.problems(python, req.source_dir, req.owner)
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise InstallError(
            f"{found[0]}{more}: the hooks would import from there as root when they start "
            f"{python}, so they would refuse it (health gating off). Every directory the "
            "interpreter imports from, and every directory on the way to each, must be root's "
            "and writable by nobody else (sticky ones such as /tmp included): make the venv "
            "as root under a directory only root can write (python3 -m venv "
            "/opt/gpuwarden/venv, docs/admin-guide.md step 2; --system-site-packages only when "
            "the system's site directories are root's alone), or chown root and chmod go-w "
            "what is named here")


def _unreachable(seen: list[tuple[trust.Seen, bool]]) -> list[str]:
    shown: dict[str, None] = {}
    for s, run in seen:
        if trust.others_cannot(s, run):
            shown[f"{s.path} ({stat.S_IMODE(s.st.st_mode):04o})"] = None
    return list(shown)


def kit_unreachable(req: Request) -> list[str]:
    """What keeps job users from the checkpoint kit under PREFIX (as far as it exists)."""
    kit = f"{req.target.prefix}/ckpt"
    try:
        seen = trust.reach(kit, missing_ok=True)
    except OSError:
        return []  # not a directory on the way: the install itself has said so
    return _unreachable([(s, False) for s in seen])


# ---- the defaults file -----------------------------------------------------------------------
def same_interpreter(named: str, python: str) -> bool:
    """Whether ``named`` starts this install: the same file in the same directory (a venv's
    python and python3), since the directory is what finds the venv's packages."""
    if named == python:
        return True
    if posixpath.dirname(named) != posixpath.dirname(python):
        return False
    try:
        return os.path.samefile(named, python)
    except (OSError, ValueError):
        return False


def _defaults_step(req: Request) -> tuple[Step, bytes | None]:
    path = req.defaults_file
    assert path is not None
    plan.check_plain_path("the defaults file", path)
    where, name = posixpath.split(path)
    try:
        with safefs.opened_dir(where, req.owner, create=False) as fd:
            found = fd is not None
            existing = safefs.read_existing(fd, name, path, req.owner)
    except InstallError as exc:
        raise InstallError(f"{exc}; {_NO_DEFAULTS}") from exc
    if not found:
        raise InstallError(f"{where} does not exist: create it (install -d -m 0755 {where}), "
                           f"{_NO_DEFAULTS}")
    mode = 0o644
    if existing is not None:
        st = existing[1]
        # The hooks ignore a file that is not theirs alone: it would name no interpreter.
        if st.st_uid != req.owner:
            fix = (f"chown root {path}" if req.owner == 0 else
                   f"run install-files as root, {_NO_DEFAULTS}")
            raise InstallError(f"{path} is owned by uid {st.st_uid}, so the hooks (root) ignore "
                               f"it: {fix}, then rerun")
        if st.st_mode & 0o022:
            raise InstallError(f"{path} is writable by group or others, so the hooks ignore it: "
                               f"chmod go-w {path}, then rerun")
        mode = stat.S_IMODE(st.st_mode)
    python = req.target.python
    change = plan.merge_defaults(path, None if existing is None else existing[0], python,
                                 req.replace_python, lambda named: same_interpreter(named, python))
    return Step(path, change.action, mode, f"{plan.PY_KEY}{change.named or python}"), change.data


@dataclass(frozen=True)
class Outcome:
    steps: list[Step]
    unreachable: list[str]  # what keeps job users from the interpreter or the kit (mode shown)


def install(req: Request) -> Outcome:
    """Check this install, every file and directory, then (unless a dry run) write what
    differs."""
    unreachable = check_runtime(req)
    sources = {sf.rel: safefs.read_source(req.source_dir, sf.rel, req.owner) for sf in plan.MANIFEST}
    outputs = plan.outputs(sources, req.target)
    steps: list[tuple[Step, bytes | None]] = []
    for out in outputs:
        path = f"{req.target.prefix}/{out.rel}"
        where, name = posixpath.split(path)
        with safefs.opened_dir(where, req.owner, create=False) as fd:
            existing = safefs.read_existing(fd, name, path, req.owner)
        if safefs.already_installed(existing, out.data, out.mode, req.owner):
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
                with safefs.opened_dir(where, req.owner, create=True) as fd:
                    assert fd is not None
                    safefs.write_at(fd, name, data, step.mode)
    unreachable += [u for u in kit_unreachable(req) if u not in unreachable]
    return Outcome([step for step, _ in steps], unreachable)
