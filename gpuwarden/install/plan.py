"""What `install-files` writes, as pure functions: the file list, the rendered files and the
defaults file the hooks read. The side effects are in gpuwarden.install.safewrite."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from gpuwarden.errors import GpuwardenError

# What the shell hooks read: the wrappers (prolog/gpuwarden-*) name this path.
DEFAULTS_FILE = "/etc/default/gpuwarden"
PY_KEY = "GPUWARDEN_PYTHON="
UNIT_PLACEHOLDER = "@GPUWARDEN@"
# Rendered into shell scripts and systemd units, which split on blanks and expand $, ` and
# quotes: a path must be plain to mean the same thing in both.
_PLAIN_PATH = re.compile(r"(/[A-Za-z0-9._+@-]+)+")


class InstallError(GpuwardenError):
    """Refused: installing would be unsafe or would change what the site chose."""


@dataclass(frozen=True)
class SiteFile:
    """One shipped file: its path under the package's sitefiles/ and under PREFIX alike."""

    rel: str
    mode: int
    kind: str = "copy"  # "copy", "unit" (ExecStart gets our gpuwarden), "sbatch" (TRAIN default)


# Everything under gpuwarden/sitefiles/, named one by one: a stray file (a .pyc, an editor's
# backup) is never installed, and a unit test keeps this list and the directory equal.
MANIFEST: tuple[SiteFile, ...] = (
    SiteFile("prolog/gpuwarden-hook.sh", 0o644),
    SiteFile("prolog/gpuwarden-prolog", 0o755),
    SiteFile("prolog/gpuwarden-healthcheck", 0o755),
    SiteFile("epilog/gpuwarden-epilog", 0o755),
    SiteFile("plugins/job_submit.lua", 0o644),
    SiteFile("plugins/cli_filter.lua", 0o644),
    SiteFile("plugins/README.md", 0o644),
    SiteFile("ckpt/train.sbatch", 0o755, "sbatch"),
    SiteFile("ckpt/train_example.py", 0o755),
    SiteFile("ckpt/README.md", 0o644),
    SiteFile("systemd/gpuwarden-placement.service", 0o644, "unit"),
    SiteFile("systemd/gpuwarden-lemon-scan.service", 0o644, "unit"),
    SiteFile("systemd/gpuwarden-lemon-scan.timer", 0o644),
)


@dataclass(frozen=True)
class Target:
    """This install: where the files go, and the interpreter and command they must name."""

    prefix: str
    python: str
    gpuwarden: str

    def __post_init__(self) -> None:
        for what, path in (("PREFIX", self.prefix), ("the interpreter", self.python),
                           ("the gpuwarden command", self.gpuwarden)):
            check_plain_path(what, path)


@dataclass(frozen=True)
class Output:
    rel: str
    data: bytes
    mode: int


def check_plain_path(what: str, path: str) -> None:
    if not _PLAIN_PATH.fullmatch(path) or any(p in ("", ".", "..") for p in path.split("/")[1:]):
        raise InstallError(
            f"{what} {path!r} is not a plain absolute path (letters, digits, '._+@-' between "
            "single slashes, no '.' or '..'): shell scripts and systemd units would read it "
            "differently; use such a path (a venv at /opt/gpuwarden/venv, for example)")


def _replace_line(text: str, key: str, value: str, rel: str) -> str:
    pattern = re.compile(rf"^{re.escape(key)}=.*$", re.MULTILINE)
    new, count = pattern.subn(f"{key}={value}", text)
    if count != 1:
        raise InstallError(f"{rel}: expected one {key}= line, found {count}: reinstall gpuwarden")
    return new


def render(sf: SiteFile, data: bytes, target: Target) -> bytes:
    """The file as this install needs it."""
    if sf.kind == "copy":
        return data
    text = data.decode()
    if sf.kind == "unit":
        if UNIT_PLACEHOLDER not in text:
            raise InstallError(f"{sf.rel}: no {UNIT_PLACEHOLDER} to replace: reinstall gpuwarden")
        return text.replace(UNIT_PLACEHOLDER, target.gpuwarden).encode()
    # The batch script is copied into Slurm's spool before it runs, so it cannot find its kit
    # from its own path: the interpreter (with gpuwarden[ckpt]) and the kit are written in.
    text = _replace_line(text, "GW_PYTHON", target.python, sf.rel)
    return _replace_line(text, "GW_KIT", f"{target.prefix}/ckpt", sf.rel).encode()


def outputs(sources: Mapping[str, bytes], target: Target) -> list[Output]:
    """Every file to write under PREFIX, rendered; ``sources`` maps MANIFEST's rel to bytes."""
    return [Output(sf.rel, render(sf, sources[sf.rel], target), sf.mode) for sf in MANIFEST]


# ---- the defaults file ---------------------------------------------------------------------
def current_python(text: str) -> str | None:
    """GPUWARDEN_PYTHON as prolog/gpuwarden-hook.sh reads it: the last such line, after an
    optional `export `, with one leading and one trailing quote removed; None when absent."""
    value = None
    for raw in text.splitlines():
        line = raw.removeprefix("export ")
        if line.startswith(PY_KEY):
            value = line[len(PY_KEY):]
    if value is None:
        return None
    if value[:1] in ("'", '"'):
        value = value[1:]
    if value[-1:] in ("'", '"'):
        value = value[:-1]
    return value


@dataclass(frozen=True)
class DefaultsChange:
    """What becomes of the defaults file: ``data`` None means it stays as it is."""

    data: bytes | None
    action: str


def merge_defaults(path: str, existing: bytes | None, python: str,
                   replace: bool) -> DefaultsChange:
    """The defaults file naming ``python``, keeping every other line a site wrote there.

    A different interpreter already named there is the site's choice: replaced only when asked."""
    line = f"{PY_KEY}{python}"
    if existing is None:
        head = "# Read by gpuwarden's Slurm hooks (docs/admin-guide.md): root's, mode 0644.\n"
        return DefaultsChange(f"{head}{line}\n".encode(), "create")
    text = existing.decode(errors="replace")
    now = current_python(text)
    if now == python:
        return DefaultsChange(None, "keep")
    if now is None:
        sep = "" if text.endswith("\n") or not text else "\n"
        return DefaultsChange(f"{text}{sep}{line}\n".encode(), "add")
    if not replace:
        raise InstallError(
            f"{path} names GPUWARDEN_PYTHON={now}, not this install's {python}: the hooks run "
            f"{now}. To make them run this install, rerun with --replace-python (the file's "
            f"other lines stay), or edit {path} yourself")
    kept = [ln for ln in text.splitlines() if not ln.removeprefix("export ").startswith(PY_KEY)]
    return DefaultsChange("".join(f"{ln}\n" for ln in [*kept, line]).encode(), "replace")
