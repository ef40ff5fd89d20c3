"""Where Slurm's commands are, without trusting PATH.

slurmd starts Prolog, Epilog and HealthCheckProgram without a PATH, so a bare `scontrol` is
looked up in Python's default (/bin:/usr/bin) and a Slurm installed anywhere else is "not
found": nothing drains. The directory comes from `[slurm] bin_dir` when set, else from where
Slurm itself runs (the running slurmd's or slurmctld's executable), else from well-known
installation prefixes. Root runs what it finds, so a directory or command that anyone but root
(or us) could replace is refused.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwarden.core.errors import SlurmError

TOOL = "scontrol"
WELL_KNOWN = ("/usr/bin", "/usr/local/bin", "/opt/slurm/bin", "/usr/local/slurm/bin")
DAEMONS = ("slurmd", "slurmctld")


class SlurmNotFoundError(SlurmError):
    """No usable directory with Slurm's commands."""


@dataclass(frozen=True)
class Place:
    path: str
    how: str  # where the candidate came from, for `config check` and selftest


def problem(directory: str, tool: str = TOOL) -> str:
    """Why ``directory`` cannot be used for Slurm's commands; "" when it can."""
    if not os.path.isabs(directory):
        return f"{directory} is not an absolute path"
    exe = os.path.join(directory, tool)
    try:
        dst = os.stat(directory)
        est = os.stat(exe)
    except OSError as exc:
        return f"{exe}: {exc.strerror or exc}"
    trusted = {0, os.geteuid()}
    for path, st in ((directory, dst), (exe, est)):
        if st.st_uid not in trusted:
            return f"{path} is owned by uid {st.st_uid}: refusing to run it as uid {os.geteuid()}"
        if st.st_mode & 0o022:
            return f"{path} is writable by group or others: refusing to run it"
    if not stat.S_ISREG(est.st_mode) or not est.st_mode & 0o111:
        return f"{exe} is not an executable file"
    return ""


def daemon_dirs(proc: str = "/proc") -> list[Place]:
    """The directories of running Slurm daemons' executables, and their installation's bin/."""
    out: list[Place] = []
    try:
        pids = [p for p in os.listdir(proc) if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            # Only root's processes: any user can start a program named slurmd (prctl,
            # a copied binary) and point the hooks at a directory of their choosing. slurmd
            # runs as root; a slurmctld running as SlurmUser is not trusted here.
            if os.stat(os.path.join(proc, pid)).st_uid != 0:
                continue
            with open(os.path.join(proc, pid, "comm"), "rb") as f:
                comm = f.read(32).decode(errors="replace").strip()
            if comm not in DAEMONS:
                continue
            exe = os.readlink(os.path.join(proc, pid, "exe"))
        except OSError:
            continue
        if not os.path.isabs(exe):
            continue
        sbin = os.path.dirname(exe.removesuffix(" (deleted)"))
        out.append(Place(os.path.join(os.path.dirname(sbin), "bin"), f"bin/ beside running {comm}"))
        out.append(Place(sbin, f"directory of running {comm}"))
    return out


def conf_dirs(environ: Mapping[str, str]) -> list[Place]:
    """The installation prefix of SLURM_CONF (<prefix>/etc/slurm.conf -> <prefix>/bin)."""
    conf = environ.get("SLURM_CONF", "")
    if not os.path.isabs(conf):
        return []
    etc = os.path.dirname(conf)
    prefixes = {os.path.dirname(etc), os.path.dirname(os.path.dirname(etc))}
    return [Place(os.path.join(p, "bin"), "installation of SLURM_CONF") for p in sorted(prefixes)
            if p not in ("", "/")]


def candidates(environ: Mapping[str, str], proc: str = "/proc",
               well_known: tuple[str, ...] = WELL_KNOWN) -> list[Place]:
    seen: set[str] = set()
    out: list[Place] = []
    for place in [*daemon_dirs(proc), *conf_dirs(environ),
                  *(Place(d, "well-known place") for d in well_known)]:
        if place.path not in seen:
            seen.add(place.path)
            out.append(place)
    return out


def locate(configured: str, *, use_path: bool, environ: Mapping[str, str] | None = None,
           proc: str = "/proc", well_known: tuple[str, ...] = WELL_KNOWN) -> Place:
    """The directory to run Slurm's commands from, or SlurmNotFoundError saying where we looked.

    ``use_path``: also accept PATH (interactive commands); never for what slurmd starts."""
    env = os.environ if environ is None else environ
    if configured:
        why = problem(configured)
        if why:
            raise SlurmNotFoundError(f"[slurm] bin_dir = {configured!r} cannot be used: {why} (set it "
                                    "to the directory holding scontrol, or leave it empty to find "
                                    "it beside slurmd)")
        return Place(configured, "[slurm] bin_dir")
    looked = []
    for place in candidates(env, proc, well_known):
        why = problem(place.path)
        if not why:
            return place
        looked.append(place.path)
    if use_path:
        found = shutil.which(TOOL, path=env.get("PATH", ""))
        if found and os.path.isabs(found) and not problem(os.path.dirname(found)):
            return Place(os.path.dirname(found), "PATH")
    raise SlurmNotFoundError(
        f"{TOOL} not found (looked beside the running slurmd/slurmctld and in "
        f"{', '.join(looked) or 'no usable place'}): set [slurm] bin_dir in the gpuwarden config "
        "to the directory holding Slurm's commands")
