"""The admin guide as the end-to-end test runs it: its marked shell blocks, and the edit the
guide leaves to the admin (merging slurm.conf lines; the config file is set by its own
`gpuwarden config set` commands).

A block the test runs is marked in the Markdown by ``<!-- e2e: NAME -->`` on the line before
its fence, so the test runs what the guide shows, and a guide edit that drops a step fails the
test instead of going unnoticed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_MARK = re.compile(r"^<!-- e2e: ([a-z0-9-]+) -->$")
# Comma lists the guide says to combine (gpuwarden.slurmconf.needs reads them as lists too).
LIST_KEYS = frozenset({"schedulerparameters", "jobsubmitplugins", "clifilterplugins",
                       "prologflags", "grestypes"})
# Keys whose every line counts: gpuwarden's line goes beside the site's.
COLLECTED = frozenset({"prolog", "epilog"})
# One program only: a site's own cannot be merged with gpuwarden's.
SINGLE_PROGRAM = frozenset({"healthcheckprogram"})


class GuideError(Exception):
    pass


@dataclass(frozen=True)
class Block:
    name: str
    text: str
    where: str  # file:line of the fence, for messages

    def commands(self) -> list[str]:
        """The block's shell lines, comments and blanks dropped, continuations joined."""
        out: list[str] = []
        pending = ""
        for raw in self.text.splitlines():
            line = pending + raw.rstrip()
            pending = ""
            if line.endswith("\\"):
                pending = line[:-1] + " "
                continue
            if line.strip() and not line.lstrip().startswith("#"):
                out.append(line)
        if pending:
            raise GuideError(f"{self.where}: the block ends inside a continued line")
        return out


def blocks(path: Path) -> dict[str, Block]:
    """Every marked fenced block of ``path`` by name."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found: dict[str, Block] = {}
    for i, line in enumerate(lines):
        m = _MARK.match(line.strip())
        if not m:
            continue
        name = m.group(1)
        if i + 1 >= len(lines) or not lines[i + 1].startswith("```"):
            raise GuideError(f"{path}:{i + 1}: marker {name!r} is not right above a ``` fence")
        try:
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        except StopIteration:
            raise GuideError(f"{path}:{i + 2}: the fence of {name!r} is never closed") from None
        if name in found:
            raise GuideError(f"{path}:{i + 1}: marker {name!r} appears twice")
        found[name] = Block(name, "\n".join(lines[i + 2:end]) + "\n", f"{path}:{i + 2}")
    return found


def _key(line: str) -> str:
    head = line.split("#", 1)[0].strip()
    return head.split("=", 1)[0].strip().lower() if "=" in head else ""


def _value(line: str) -> str:
    return line.split("#", 1)[0].strip().split("=", 1)[1].strip()


def _option(item: str) -> str:
    return item.split("=", 1)[0].strip().lower()


def merge_slurm_conf(site: str, lines: Block) -> str:
    """Step 8's merge, by the rules the guide states: a key the site's file lacks is added;
    Prolog/Epilog lines go beside the site's; comma lists get the items whose option they lack
    (the site's own setting of an option stays); HealthCheckProgram, one program, is an error
    when the site runs another; any other key keeps the site's value, for `slurm-conf --check`
    to judge. Commented-out lines of the block are left out."""
    site_lines = site.splitlines()
    index = {k: i for i, line in enumerate(site_lines) if (k := _key(line))}
    appended: list[str] = []
    for line in lines.commands():
        key = _key(line)
        if not key:
            raise GuideError(f"{lines.where}: {line!r} is not a Key=value line")
        name, value = line.split("=", 1)[0].strip(), _value(line)
        if key not in index:
            appended.append(f"{name}={value}")
            continue
        i = index[key]
        theirs = _value(site_lines[i])
        if key in COLLECTED:
            if all(_key(x) != key or _value(x) != value for x in site_lines):
                appended.append(f"{name}={value}")
        elif key in LIST_KEYS:
            items = [x for x in theirs.split(",") if x]
            have = {_option(x) for x in items}
            items += [x for x in value.split(",") if x and _option(x) not in have]
            site_lines[i] = f"{site_lines[i].split('=', 1)[0].strip()}={','.join(items)}"
        elif key in SINGLE_PROGRAM and theirs != value:
            raise GuideError(f"the site's {name}={theirs} and gpuwarden's {value}: Slurm runs "
                             "one; see the guide's step 8")
    body = "\n".join(site_lines) + "\n"
    if appended:
        body += "# gpuwarden (docs/admin-guide.md, step 8)\n" + "\n".join(appended) + "\n"
    return body
