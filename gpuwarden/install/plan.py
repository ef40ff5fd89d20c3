"""What `install-files` writes, as pure functions: the file list, the rendered files and the
defaults file the hooks read. The side effects are in gpuwarden.core.safefs (installwrite)."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

# Defined in core, where safefs's walk raises it; install's own refusals are the same error,
# named here too (plan.InstallError).
from gpuwarden.core.errors import InstallError as InstallError  # noqa: PLC0414 - re-exported

# What the shell hooks read: the wrappers (prolog/gpuwarden-*) name this path.
DEFAULTS_FILE = "/etc/default/gpuwarden"
PY_KEY = "GPUWARDEN_PYTHON="
UNIT_PLACEHOLDER = "@GPUWARDEN@"
# Rendered into shell scripts and systemd units, which split on blanks and expand $, ` and
# quotes: a path must be plain to mean the same thing in both.
_PLAIN_PATH = re.compile(r"(/[A-Za-z0-9._+@-]+)+")


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
    SiteFile("prolog/gpuwarden_pystart.py", 0o644),
    SiteFile("prolog/gpuwarden-prolog", 0o755),
    SiteFile("prolog/gpuwarden-healthcheck", 0o755),
    SiteFile("epilog/gpuwarden-epilog", 0o755),
    SiteFile("plugins/job_submit.lua", 0o644),
    SiteFile("plugins/cli_filter.lua", 0o644),
    SiteFile("plugins/README.md", 0o644),
    SiteFile("ckpt/train.sbatch", 0o755, "sbatch"),
    SiteFile("ckpt/train_spares.sbatch", 0o755, "sbatch"),
    SiteFile("ckpt/train_example.py", 0o755),
    SiteFile("ckpt/train_torch_example.py", 0o755),
    SiteFile("ckpt/README.md", 0o644),
    SiteFile("systemd/gpuwarden-placement.service", 0o644, "unit"),
    SiteFile("systemd/gpuwarden-lemon-scan.service", 0o644, "unit"),
    SiteFile("systemd/gpuwarden-lemon-scan.timer", 0o644),
    SiteFile("systemd/gpuwarden-accounting-sync.service", 0o644, "unit"),
    SiteFile("systemd/gpuwarden-accounting-sync.timer", 0o644),
    SiteFile("systemd/gpuwarden-ckpt-tidy.service", 0o644, "unit"),
    SiteFile("systemd/gpuwarden-ckpt-tidy.timer", 0o644),
    # For the site's Prometheus and Grafana (docs/monitoring.md), copied to where they load.
    SiteFile("prometheus/gpuwarden.rules.yml", 0o644),
    SiteFile("grafana/gpuwarden.json", 0o644),
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
# Read as the hooks' `while IFS= read -r` reads it: bytes, lines split on \n alone (a \r stays
# in the value), so what this reports is what the hooks run.
_PY_KEY = PY_KEY.encode()


def _lines(data: bytes) -> list[bytes]:
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()
    return lines


def _names_python(line: bytes) -> bool:
    return line.removeprefix(b"export ").startswith(_PY_KEY)


def current_python(data: bytes) -> str | None:
    """GPUWARDEN_PYTHON as prolog/gpuwarden-hook.sh reads it: the last such line, after an
    optional `export `, with one leading and one trailing quote removed; None when absent.
    Bytes that are not UTF-8 come back as surrogates (they match no plain path)."""
    value = None
    for line in _lines(data):
        if _names_python(line):
            value = line.removeprefix(b"export ")[len(_PY_KEY):]
    if value is None:
        return None
    if value[:1] in (b"'", b'"'):
        value = value[1:]
    if value[-1:] in (b"'", b'"'):
        value = value[:-1]
    return value.decode(errors="surrogateescape")


@dataclass(frozen=True)
class DefaultsChange:
    """What becomes of the defaults file: ``data`` None means it stays as it is; ``named`` is
    the interpreter it names when kept (another spelling of this one)."""

    data: bytes | None
    action: str
    named: str | None = None


def _why_not_run(value: str) -> str:
    """What makes a named interpreter no file the hooks could start, beyond being another."""
    if "\r" in value:
        return (" (a carriage return, \\r: the file was saved with Windows line endings; the "
                "hooks keep it as part of the name, find no such interpreter and leave health "
                "gating off)")
    if any(c.isspace() or not c.isprintable() for c in value):
        return (" (it holds blanks or control characters, which the hooks keep as part of the "
                "name: no such interpreter, so health gating is off)")
    return ""


def merge_defaults(path: str, existing: bytes | None, python: str, replace: bool,
                   is_this: Callable[[str], bool]) -> DefaultsChange:
    """The defaults file naming ``python``, keeping every other line a site wrote there byte
    for byte. ``is_this`` says whether a named interpreter is this one spelled differently.

    A different interpreter already named there is the site's choice: replaced only when asked."""
    line = f"{PY_KEY}{python}\n".encode()
    if existing is None:
        head = b"# Read by gpuwarden's Slurm hooks (docs/admin-guide.md): root's, mode 0644.\n"
        return DefaultsChange(head + line, "create")
    now = current_python(existing)
    if now is not None and is_this(now):
        return DefaultsChange(None, "keep", now)
    if now is None:
        sep = b"" if existing.endswith(b"\n") or not existing else b"\n"
        return DefaultsChange(existing + sep + line, "add")
    if not replace:
        odd = _why_not_run(now)
        shown = ascii(now) if odd else now
        raise InstallError(
            f"{path} names GPUWARDEN_PYTHON={shown}, not this install's {python}: the hooks run "
            f"{shown}{odd}. To make them run this install, rerun with "
            f"--replace-python (the file's other lines stay), or edit {path} yourself")
    kept = b"".join(ln + b"\n" for ln in _lines(existing) if not _names_python(ln))
    return DefaultsChange(kept + line, "replace")
