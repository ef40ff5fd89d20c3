"""`gpuwarden slurm-conf --check FILE` and `--part gpuwarden`: a site's slurm.conf against what
each gpuwarden feature needs (gpuwarden.slurmconf.needs.NEEDS), and the merged block of those lines.

One finding per line: ``ok``, ``missing`` or ``conflict`` (and ``unread`` for a file we could
not read), the feature, what was found, and after ``->`` the exact line to write. Every key is
also checked against the keys of the Slurm release at hand (gpuwarden.slurmconf.keys): one it does not know
stops slurmctld. Exit 0 when everything the checked features need is there, 1 when something is
missing or conflicts, 2 when a file could not be read (the findings may then be incomplete).
"""

from __future__ import annotations

import glob
import logging
import os
import re
import stat
import textwrap
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gpuwarden.config.placement import PlacementConfig
from gpuwarden.core.errors import SlurmError
from gpuwarden.slurm.runner import CommandRunner
from gpuwarden.slurmconf.keys import Version, judge_key, parse_version, show
from gpuwarden.slurmconf.needs import (
    CONFLICT,
    FEATURES,
    HOOK_LIMIT_S,
    HOOKS,
    MISSING,
    NEEDS,
    OK,
    UNREAD,
    Beside,
    Need,
    Site,
    Verdict,
    items,
    keys_for,
    merged,
    option_name,
    wanted,
)
from gpuwarden.slurmconf.read import COLLECTED, SlurmConf, UnreadableError, read, read_regular

log = logging.getLogger(__name__)
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
    out.extend(_unknown_keys(conf, site.slurm_version))
    out.extend(Finding(UNREAD if p.unreadable else CONFLICT, ("slurm.conf",),
                       f"{p.where}: {p.message}") for p in conf.problems)
    return out


def _unknown_keys(conf: SlurmConf, version: Version | None) -> list[Finding]:
    """Keys the Slurm at hand does not know: slurmctld stops at the first."""
    out: list[Finding] = []
    for s in conf.settings:
        bad = judge_key(s.key, version)
        if bad is not None:
            out.append(Finding(CONFLICT, ("slurm.conf",), f"{s.where}: {bad[0]}", bad[1]))
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
def block(features: Iterable[str] = tuple(FEATURES), hooks: dict[str, str] | None = None,
          slurm_version: Version | None = None) -> str:
    """The slurm.conf lines the features need, one line per key, each under a comment that says
    which feature needs it and why, written for ``slurm_version`` (None: unknown, lines every
    supported release reads)."""
    on = [f for f in FEATURES if f in set(features)]
    paths = {**HOOKS, **(hooks or {})}
    site = Site(slurm_version=slurm_version)
    written_for = f"Slurm {show(slurm_version)}" if slurm_version else \
        "any Slurm from 24.05 (release unknown: --slurm-version names it)"
    lines = [f"# gpuwarden: the slurm.conf lines for {', '.join(FEATURES[f] for f in on)}.",
             f"# Written for {written_for}.",
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
        lines.extend(f"{'' if mine[0].block else '#'}{k}={value}"
                     for k in keys_for(key, slurm_version))
    return "\n".join(lines) + "\n"


# ---- gathering --------------------------------------------------------------------------------
def placement_wait_s(placement: PlacementConfig) -> int:
    """The longest wait_s of a "preferred" partition policy: max_switch_wait must allow it
    ("required" waits as long as max_switch_wait allows, whatever it is)."""
    policies = [placement.default, *placement.partitions.values()]
    return max((p.wait_s for p in policies if p.mode == "preferred"), default=0)


def site_for(conf: SlurmConf, placement_wait_s: int,
             expand: Callable[[str], list[str]] = glob.glob,
             defaults_file: str = DEFAULTS_FILE, slurm_version: Version | None = None,
             cluster_set: bool = False) -> Site:
    """The files beside slurm.conf that the needs look at, read as regular files only, and the
    hooks' limit from this host's defaults file."""
    beside: dict[str, str] = {}
    unusable: dict[str, Beside] = {}
    for name in BESIDE:
        text, bad = beside_file(os.path.join(conf.directory, name))
        if text is not None:
            beside[name] = text
        elif bad is not None:
            unusable[name] = bad
    limit = hook_limit(defaults_file)
    return Site(beside=beside, unusable=unusable, placement_wait_s=placement_wait_s,
                expand=expand, hook_limit_s=limit or HOOK_LIMIT_S,
                hook_limit_from=f"GPUWARDEN_HOOK_LIMIT_S in {defaults_file}" if limit else "",
                slurm_version=slurm_version, cluster_set=cluster_set)


def beside_file(path: str) -> tuple[str | None, Beside | None]:
    """(text, None) for a regular file we read; (None, why) for a name that is there but
    cannot be used; (None, None) when nothing is. Links are followed, as Slurm follows them
    (the guide links the plugins in); one that leads nowhere is no file to Slurm either."""
    got = read_regular(path)
    if got.text is not None:
        return got.text, None
    return None, None if got.absent else Beside(got.why, got.denied)


def running_version(runner: CommandRunner, timeout: float = 10.0) -> Version | None:
    """The release of this host's Slurm (``scontrol --version``), None when there is none."""
    try:
        res = runner.run(["scontrol", "--version"], timeout)
    except SlurmError as exc:
        log.debug("no Slurm version: %s", exc)
        return None
    return parse_version(res.stdout) if res.returncode == 0 else None


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


def check(path: str, features: Iterable[str], placement_wait_s: int,
          echo: Callable[[str], None], echo_err: Callable[[str], None] | None = None,
          defaults_file: str = DEFAULTS_FILE, slurm_version: Version | None = None,
          version_from: str = "", cluster_set: bool = False) -> int:
    """Print the findings for ``path``; the exit code (module doc). ``slurm_version``: the
    release the keys are checked against, found by ``version_from``; None: unknown."""
    on = [f for f in FEATURES if f in set(features)]
    try:
        conf = read(path)
    except UnreadableError as exc:
        (echo_err or echo)(f"gpuwarden: cannot read {exc}; give the path of slurm.conf (scontrol show config "
             "| grep SLURM_CONF says where it is), and run as root if it is not readable")
        return EXIT_UNREADABLE
    site = site_for(conf, placement_wait_s, defaults_file=defaults_file,
                    slurm_version=slurm_version, cluster_set=cluster_set)
    findings = evaluate(conf, site, on)
    included = len(conf.files) - 1
    against = f"Slurm {show(slurm_version)} ({version_from})" if slurm_version else \
        "Slurm of unknown release (no answer from scontrol --version here: " \
        "--slurm-version names it)"
    echo(f"# {path}{f' and {included} included file(s)' if included else ''}, checked for "
         f"{', '.join(FEATURES[f] for f in on)}, against {against}")
    for f in findings:
        echo(f.line())
    echo(summary(findings, on))
    return exit_code(findings)
