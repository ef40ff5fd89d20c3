"""Whose code root will run. install-files names this install's interpreter and `gpuwarden` in
the hooks, units and train.sbatch, which start them as root on every node: whoever could change
the venv, its site-packages or the interpreter would choose what root runs. So every directory
on the way to them and everything in them must be root's (or the installer's) alone, as
gpuwarden.core.safefs (opened_dir) requires of where it writes.

Also what job users can reach: train.sbatch runs the interpreter and the kit as the job's user.

Read-only checks of the tree as it is: the installer writes nothing here.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator

# One walk for every check: the hooks' rule (gpuwarden_pystart.py) and this install's.
from gpuwarden.sitefiles.prolog.gpuwarden_pystart import Seen, reach

__all__ = ["Seen", "control_problem", "others_cannot", "reach", "tree"]


def tree(root: str) -> Iterator[Seen]:
    """Everything below directory ``root``, links followed (each directory walked once)."""
    stack = [root]
    walked: set[tuple[int, int]] = set()
    while stack:
        with os.scandir(stack.pop()) as entries:
            for entry in entries:
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISLNK(st.st_mode):
                    # A dangling link still counts: whoever controls its way could fill it.
                    chain = reach(entry.path, missing_ok=True)
                    yield from chain
                    last = chain[-1]
                    if last.on_way:
                        continue
                    st = last.st
                    path = last.path
                else:
                    yield Seen(entry.path, st, False)
                    path = entry.path
                if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) not in walked:
                    walked.add((st.st_dev, st.st_ino))
                    stack.append(path)


def control_problem(seen: Seen, owner: int) -> str:
    """Why someone other than root or ``owner`` could change what is reached through ``seen``;
    empty when nobody can. A sticky directory on the way is fine (/tmp): others cannot rename
    what is not theirs in it."""
    st = seen.st
    if st.st_uid not in (0, owner):
        return f"{seen.path} is owned by uid {st.st_uid}"
    sticky_way = seen.on_way and st.st_mode & stat.S_ISVTX
    if st.st_mode & 0o022 and not sticky_way:
        return f"{seen.path} is writable by group or others"
    return ""


def others_cannot(seen: Seen, run: bool = False) -> bool:
    """Whether a user who is neither its owner nor in its group is kept out: a directory on the
    way needs o+x, one to read o+rx, a file o+r, one to ``run`` o+rx."""
    if seen.on_way:
        need = 0o001
    elif stat.S_ISDIR(seen.st.st_mode) or run:
        need = 0o005
    else:
        need = 0o004
    return seen.st.st_mode & need != need
