"""`gpuwarden slurm-conf --check FILE` and `--part gpuwarden`: a site's slurm.conf against what
each gpuwarden feature needs (slurmconfneeds.NEEDS), and the merged block of those lines.

One finding per line: ``ok``, ``missing`` or ``conflict`` (and ``unread`` for an Include we
could not read), the feature, what was found, and after ``->`` the exact line to write. Exit 0
when everything the checked features need is there, 1 when something is missing or conflicts,
2 when a file could not be read (the findings may then be incomplete).
"""

from __future__ import annotations

import glob
import os
import re
import stat
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwarden.placement.config import PlacementConfig
from gpuwarden.slurmconfneeds import (
    CONFLICT,
    FEATURES,
    HOOK_LIMIT_S,
    HOOKS,
    MISSING,
    NEEDS,
    OK,
    Need,
    Site,
    Verdict,
    items,
    merged,
    option_name,
    wanted,
)
from gpuwarden.slurmconfread import COLLECTED, SlurmConf, UnreadableError, read

UNREAD = "unread"
BESIDE = ("job_submit.lua", "cli_filter.lua", "topology.conf", "topology.yaml")
# Where the hooks read GPUWARDEN_HOOK_LIMIT_S from (the wrappers in sitefiles/ name it).
DEFAULTS_FILE = "/etc/default/gpuwarden"
EXIT_OK, EXIT_MISSING, EXIT_UNREADABLE = 0, 1, 2


@dataclass(frozen=True)
class Finding:
    severity: str
    features: tuple[str, ...]
    found: str
    fix: str = ""

    def line(self) -> str:
        what = ", ".join(FEATURES.get(f, f) for f in self.features)
        return f"{self.severity:<8}  {what}: {self.found}" + (f" -> {self.fix}" if self.fix else "")


def evaluate(conf: SlurmConf, site: Site, features: Iterable[str]) -> list[Finding]:
    on = set(features)
    applies: list[tuple[Need, Verdict]] = []
    for n in NEEDS:
        if on & set(n.features):
            v = n.judge(n, conf, site)
            if v is not None:  # None: not needed at this site (topology/block ...)
                applies.append((n, v))
    out: list[Finding] = []
    for n, v in applies:
        fix = v.fix
        if v.item:
            # One line per key holding every item the checked features lack there.
            last = conf.last(n.key)
            fix = f"{v.fix}set: {merged(n.key, last.value if last else '', _lacking(applies, n.key, site))}"
        out.append(Finding(v.severity, tuple(f for f in n.features if f in on), v.found, fix))
    out.extend(_duplicates(conf, site, applies, on))
    out.extend(Finding(UNREAD if p.unreadable else CONFLICT, ("slurm.conf",),
                       f"{p.where}: {p.message}") for p in conf.problems)
    return out


def _lacking(applies: list[tuple[Need, Verdict]], key: str, site: Site) -> list[str]:
    return [wanted(n, site) for n, v in applies if n.key == key and v.item]


def _duplicates(conf: SlurmConf, site: Site, applies: list[tuple[Need, Verdict]],
                on: set[str]) -> list[Finding]:
    """A key gpuwarden needs, given more than once: Slurm keeps only the last line."""
    out: list[Finding] = []
    for key in dict.fromkeys(n.key for n, _ in applies):
        lines = conf.all(key)
        if key.lower() in COLLECTED or len(lines) < 2:
            continue
        needs = [n for n, _ in applies if n.key == key]
        feats = tuple(dict.fromkeys(f for n in needs for f in n.features if f in on))
        if needs[0].listed:
            union: dict[str, str] = {}
            for s in lines:
                for item in items(s.value):
                    union[option_name(item)] = item
            keep = merged(key, ",".join(union.values()), _lacking(applies, key, site))
        else:
            keep = f"{key}={lines[-1].value}"
        where = ", ".join(s.where for s in lines)
        out.append(Finding(CONFLICT, feats, f"{key} is set {len(lines)} times ({where}): Slurm "
                           f"keeps only the last, {lines[-1].key}={lines[-1].value}",
                           f"keep one line: {keep}"))
    return out


def exit_code(findings: list[Finding]) -> int:
    if any(f.severity == UNREAD for f in findings):
        return EXIT_UNREADABLE
    return EXIT_OK if all(f.severity == OK for f in findings) else EXIT_MISSING


def summary(findings: list[Finding], features: Iterable[str]) -> str:
    what = ", ".join(FEATURES[f] for f in features)
    count = {sev: sum(f.severity == sev for f in findings) for sev in (MISSING, CONFLICT, UNREAD)}
    if not any(count.values()):
        return f"nothing missing for {what}"
    parts = [f"{n} {sev}" for sev, n in count.items() if n]
    advice = "write the lines after '->'; all of gpuwarden's lines: gpuwarden slurm-conf " \
             "--part gpuwarden"
    if count[UNREAD]:
        advice = "some files could not be read, so this list may be incomplete: run it as root"
    return f"{', '.join(parts)}: {advice}"


# ---- the merged block -------------------------------------------------------------------------
def block(features: Iterable[str] = tuple(FEATURES), hooks: dict[str, str] | None = None) -> str:
    """The slurm.conf lines the features need, one line per key, each under a comment that says
    which feature needs it and why."""
    on = [f for f in FEATURES if f in set(features)]
    paths = {**HOOKS, **(hooks or {})}
    site = Site()
    lines = [f"# gpuwarden: the slurm.conf lines for {', '.join(FEATURES[f] for f in on)}.",
             "# Merge them into slurm.conf: where a key is there already, combine the values on",
             "# ONE line (Slurm keeps only the last line of a key; Prolog and Epilog excepted)."]
    if "placement" in on:
        lines += ["# Put job_submit.lua beside slurm.conf BEFORE adding JobSubmitPlugins=lua: "
                  "without", "# it slurmctld does not start."]
    lines.append("# Then: gpuwarden slurm-conf --check <your slurm.conf>")
    needs = [n for n in NEEDS if set(on) & set(n.features)]
    for key in dict.fromkeys(n.key for n in needs):
        mine = [n for n in needs if n.key == key]
        value = ",".join(wanted(n, site) for n in mine) if mine[0].listed else \
            paths.get(key, mine[0].value)
        for n in mine:
            feats = ", ".join(FEATURES[f] for f in n.features if f in on)
            lines.extend(textwrap.wrap(f"{feats}: {n.why}", 94, initial_indent="# ",
                                       subsequent_indent="#   "))
        lines.append(f"{'' if mine[0].block else '#'}{key}={value}")
    return "\n".join(lines) + "\n"


# ---- gathering --------------------------------------------------------------------------------
def placement_wait_s(placement: PlacementConfig) -> int:
    """The longest wait_s of a "preferred" partition policy: max_switch_wait must allow it
    ("required" waits as long as max_switch_wait allows, whatever it is)."""
    policies = [placement.default, *placement.partitions.values()]
    return max((p.wait_s for p in policies if p.mode == "preferred"), default=0)


def site_for(conf: SlurmConf, placement_wait_s: int,
             expand: Callable[[str], list[str]] = glob.glob,
             defaults_file: str = DEFAULTS_FILE) -> Site:
    """The files beside slurm.conf that the needs look at, read as regular files only, and the
    hooks' limit from this host's defaults file."""
    beside: dict[str, str] = {}
    for name in BESIDE:
        path = os.path.join(conf.directory, name)
        if os.path.lexists(path):
            try:
                beside[name] = read_text(path)
            except OSError:
                beside[name] = ""  # there, but not readable by us: presence is what matters
    limit = hook_limit(defaults_file)
    return Site(beside=beside, placement_wait_s=placement_wait_s, expand=expand,
                hook_limit_s=limit or HOOK_LIMIT_S,
                hook_limit_from=f"GPUWARDEN_HOOK_LIMIT_S in {defaults_file}" if limit else "")


def hook_limit(path: str) -> int:
    """GPUWARDEN_HOOK_LIMIT_S as the hooks read it from ``path`` (prolog/gpuwarden-hook.sh
    gw_python: only from a root-owned file nobody else can write; the last valid line wins;
    whole seconds 1-99999); 0 when none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return 0
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (0, os.geteuid()) or \
                st.st_mode & 0o022:
            return 0
        text = f.read(1 << 16).decode("utf-8", errors="replace")
    found = 0
    for line in text.splitlines():
        value = line.removeprefix("export ").partition("GPUWARDEN_HOOK_LIMIT_S=")
        if value[0] == "" and value[1] and re.fullmatch(r"[1-9][0-9]{0,4}", value[2]):
            found = int(value[2])
    return found


def read_text(path: str, limit: int = 1 << 20) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path}: not a regular file")
        return f.read(limit).decode("utf-8", errors="replace")


def check(path: str, features: Iterable[str], placement_wait_s: int,
          echo: Callable[[str], None], echo_err: Callable[[str], None] | None = None,
          defaults_file: str = DEFAULTS_FILE) -> int:
    """Print the findings for ``path``; the exit code (module doc)."""
    on = [f for f in FEATURES if f in set(features)]
    try:
        conf = read(path)
    except UnreadableError as exc:
        (echo_err or echo)(f"gpuwarden: cannot read {exc}; give the path of slurm.conf (scontrol show config "
             "| grep SLURM_CONF says where it is), and run as root if it is not readable")
        return EXIT_UNREADABLE
    findings = evaluate(conf, site_for(conf, placement_wait_s, defaults_file=defaults_file), on)
    included = len(conf.files) - 1
    echo(f"# {path}{f' and {included} included file(s)' if included else ''}, checked for "
         f"{', '.join(FEATURES[f] for f in on)}")
    for f in findings:
        echo(f.line())
    echo(summary(findings, on))
    return exit_code(findings)
