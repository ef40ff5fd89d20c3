"""The one rule for the Python the Slurm hooks run as root, and the hooks' Python start.

The rule: every directory Python imports from for the hooks (the interpreter and its real
path, the standard library, lib-dynload, every site directory, the system's too in a venv made
with --system-site-packages, every .pth file and what its lines add, gpuwarden's package) and
every directory on the way to each, links followed hop by hop, is root's and writable by
nobody else. A sticky directory (/tmp) is refused too: whoever can write there can put a file
of theirs where an import looks. Else root would run code another user chose: a .pth file or a
sitecustomize.py dropped in a group-writable directory runs at every interpreter start.

Applied three times, by the same code: `gpuwarden install-files` and `gpuwarden health
selftest` run ``PYTHON -I -S gpuwarden_pystart.py --check`` (every file below each directory
too), and prolog/gpuwarden-hook.sh starts every hook as ``PYTHON -I -S gpuwarden_pystart.py
HOOK STDLIB``, after its own check (gw_check_python) of what runs before this file: the
interpreter, the venv's pyvenv.cfg and the standard library's top level with `encodings`.
-S: no site directory is read, so no .pth file or sitecustomize runs, until this file has
checked them (then it adds them as site.py would, user site off as -I keeps it); each module
imported after that is checked before it runs (ImportGuard), so a package directory deeper
down is covered as well.

This file is shipped beside the hooks and imported by the package as
gpuwarden.sitefiles.prolog.gpuwarden_pystart. It runs before anything but the interpreter's
frozen modules and the standard library's top level is trusted, so it imports nothing else
at first (no dataclasses: they import re, inspect and more).
"""

# No `from __future__ import annotations`: that is a module read from the standard library
# before the import guard exists (annotations naming typing-only names are quoted instead).
import os
import stat
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Sequence
    from importlib.machinery import ModuleSpec
    from types import ModuleType

EXIT_CANNOT_IMPORT = 87  # gpuwarden.hooks.run cannot be imported (the wrapper says so)
EXIT_UNTRUSTED = 88  # the rule refused: nothing of the hook ran
_MAX_LINKS = 40  # as the kernel's ELOOP limit
ROOT_ONLY = (0,)
_SITE_NAMES = ("site-packages", "dist-packages")


class Seen:
    """One thing on the way to a path: a directory a name is looked up in (``on_way``), or the
    thing the path names, links followed."""

    __slots__ = ("on_way", "path", "st")

    def __init__(self, path: str, st: os.stat_result, on_way: bool) -> None:
        self.path = path  # as reached: no links in it
        self.st = st
        self.on_way = on_way


def reach(path: str, missing_ok: bool = False) -> list[Seen]:
    """Every directory a lookup of absolute ``path`` passes through, following links as exec
    and import do, then what it names. A missing component raises FileNotFoundError, or with
    ``missing_ok`` ends the list there (the directory it is missing from is the last)."""
    cur, st = "/", os.lstat("/")
    todo = [p for p in path.split("/") if p not in ("", ".")]
    seen: list[Seen] = []
    links = 0
    while todo:
        name = todo.pop(0)
        seen.append(Seen(cur, st, True))
        if name == "..":
            cur = os.path.dirname(cur)
            st = os.lstat(cur)
            continue
        nxt = os.path.join(cur, name)
        try:
            nst = os.lstat(nxt)
        except (FileNotFoundError, NotADirectoryError):
            if missing_ok:
                return seen
            raise
        if stat.S_ISLNK(nst.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise OSError(40, os.strerror(40), path)  # ELOOP
            target = os.readlink(nxt)
            if target.startswith("/"):
                cur, st = "/", os.lstat("/")
            todo[:0] = [p for p in target.split("/") if p not in ("", ".")]
            continue
        cur, st = nxt, nst
    seen.append(Seen(cur, st, False))
    return seen


def problem(seen: Seen, owners: "Sequence[int]" = ROOT_ONLY) -> str:
    """Why someone other than root (or ``owners``) could change what is reached through
    ``seen``; empty when nobody can. No exception for sticky directories."""
    st = seen.st
    if st.st_uid not in owners:
        return f"{seen.path} is owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        sticky = ", sticky or not" if st.st_mode & stat.S_ISVTX else ""
        return f"{seen.path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):04o}{sticky})"
    return ""


class Checker:
    """The rule over paths, each thing looked at once; ``problems`` collects what it refused."""

    def __init__(self, owners: "Sequence[int]" = ROOT_ONLY) -> None:
        self.owners = tuple(owners)
        self.good: set[str] = set()
        self.problems: list[str] = []

    def path(self, what: str, path: str, missing_ok: bool = True) -> str:
        """Check ``path`` and the way to it; returns (and keeps) the problem, "" when none. A
        missing path is fine when its directory is root's alone: nobody else can create it."""
        try:
            chain = reach(os.path.abspath(path), missing_ok)
        except OSError as exc:
            return self._refuse(f"cannot check {path} ({exc.strerror})", what)
        for s in chain:
            if s.path in self.good:
                continue
            why = problem(s, self.owners)
            if why:
                return self._refuse(why, what)
            self.good.add(s.path)
        return ""

    def below(self, what: str, root: str, depth: int = 1_000, skip: tuple[str, ...] = ()) -> None:
        """What is in directory ``root``, ``depth`` levels down, but for entries named in
        ``skip`` (install-files and selftest: too slow for every job start, where ImportGuard
        checks what is imported instead)."""
        for s in _tree(root, depth, skip):
            if s.path not in self.good:
                why = problem(s, self.owners)
                if why:
                    self._refuse(why, what)
                    return
                self.good.add(s.path)

    def _refuse(self, why: str, what: str) -> str:
        line = f"{why} ({what})"
        if line not in self.problems:
            self.problems.append(line)
        return line


def _tree(root: str, depth: int, skip: tuple[str, ...] = ()) -> "Iterator[Seen]":
    """What is below directory ``root``, ``depth`` levels down, links followed (each directory
    walked once)."""
    stack = [(root, depth)]
    walked: set[tuple[int, int]] = set()
    while stack:
        top, left = stack.pop()
        try:
            entries = list(os.scandir(top))
        except OSError:
            continue
        for entry in entries:
            if entry.name in skip:
                continue
            st = entry.stat(follow_symlinks=False)
            path = entry.path
            if stat.S_ISLNK(st.st_mode):
                try:
                    chain = reach(path, missing_ok=True)
                except OSError:
                    continue
                yield from chain
                if chain[-1].on_way:
                    continue
                st, path = chain[-1].st, chain[-1].path
            else:
                yield Seen(path, st, False)
            if left > 1 and stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) not in walked:
                walked.add((st.st_dev, st.st_ino))
                stack.append((path, left - 1))


# ---- what the hooks' interpreter imports from ------------------------------------------------
def venv_cfg(executable: str) -> str | None:
    """The pyvenv.cfg that makes ``executable`` a venv's (beside it or one directory up, as
    Python looks for it), or None."""
    here = os.path.dirname(executable)
    for d in (here, os.path.dirname(here)):
        cfg = os.path.join(d, "pyvenv.cfg")
        if os.path.lexists(cfg):
            return cfg
    return None


def check_startup(c: Checker, stdlib: "Sequence[str]" = ()) -> None:
    """What Python read before this file ran: the interpreter (as named and its real file),
    pyvenv.cfg, the initial sys.path (-I -S: the standard library, its zip, lib-dynload) and the
    `encodings` package imported at startup. ``stdlib``: where the wrapper checked the standard
    library before starting Python; the one loaded must be one of them."""
    for exe in dict.fromkeys([sys.executable, getattr(sys, "_base_executable", sys.executable)]):
        if exe:
            c.path("the interpreter", exe, missing_ok=False)
    here = os.path.dirname(sys.executable)
    for cfg in (os.path.join(here, "pyvenv.cfg"), os.path.join(os.path.dirname(here), "pyvenv.cfg")):
        if os.path.lexists(cfg):  # both count: Python and site.py each read the one they find first
            c.path("the venv's pyvenv.cfg", cfg, missing_ok=False)
    for entry in sys.path:
        c.path("the standard library", entry or os.getcwd())
    enc = sys.modules.get("encodings")
    for d in list(getattr(enc, "__path__", [])):
        c.path("the standard library", d)
        loaded = os.path.realpath(os.path.dirname(d))
        if stdlib and loaded not in {os.path.realpath(s) for s in stdlib}:
            c.problems.append(f"the standard library loaded ({loaded}) is not the one checked "
                              f"before Python started ({', '.join(stdlib)})")
    # Whatever was imported from a file before this file's guard existed (its links followed).
    for name, mod in list(sys.modules.items()):
        spec = getattr(mod, "__spec__", None)
        if spec is not None and spec.has_location:
            for p in (spec.origin, spec.cached):
                if p:
                    c.path(f"module {name}, imported as Python started", p)
    if not sys.flags.no_user_site:
        c.problems.append("the user's site directory is enabled: start Python with -I")


def site_dirs() -> list[str]:
    """The site directories site.py would add for this interpreter: its venv's, then the
    system's when pyvenv.cfg says include-system-site-packages (user site off, as -I keeps it).
    Read here, not by site.venv(), which processes the venv's .pth files as it goes."""
    import site  # noqa: PLC0415 - checked by the wrapper; imported only when needed

    prefixes = [sys.prefix]
    cfg = venv_cfg(sys.executable)
    if cfg and os.path.isfile(cfg):
        system = True
        with open(cfg, encoding="utf-8") as f:
            for line in f:
                key, eq, value = line.partition("=")
                if eq and key.strip().lower() == "include-system-site-packages":
                    system = value.strip().lower() == "true"
        venv = os.path.dirname(os.path.dirname(os.path.abspath(sys.executable)))
        # The system's prefix is base_prefix: Python 3.14 sets sys.prefix to the venv itself
        # at start (-S too), where 3.13 left it to site.py (seen on Debian's 3.14: the system's
        # site directories were missed, and the hooks failed open for want of click).
        prefixes = [venv, sys.base_prefix] if system else [venv]
        # As site.venv(): what sysconfig and gpuwarden see is the venv.
        sys.prefix = sys.exec_prefix = venv
    return list(dict.fromkeys(site.getsitepackages(prefixes)))


def pth_lines(sitedir: str) -> "Iterator[tuple[str, str]]":
    """(.pth file, what it adds to sys.path) for each path line, read as site.py reads them;
    `import` lines run code, trusted once the file and its directory are."""
    try:
        names = sorted(os.listdir(sitedir))
    except OSError:
        return
    for name in names:
        if not name.endswith(".pth"):
            continue
        pth = os.path.join(sitedir, name)
        yield pth, ""
        try:
            # Universal newlines, as site.py reads it (not str.splitlines: more separators).
            with open(pth, encoding="utf-8", errors="surrogateescape") as f:
                lines = f.read().split("\n")
        except OSError:
            continue
        for line in lines:
            if not line.strip() or line.startswith("#") or line.startswith(("import ", "import\t")):
                continue
            yield pth, os.path.join(sitedir, line.rstrip())


def check_sites(c: Checker, sites: "Iterable[str]", deep: bool) -> list[str]:
    """Each site directory, its .pth files and what they add; returns the directories to add."""
    added = []
    for d in sites:
        if c.path("a site directory", d) or not os.path.isdir(d):
            continue
        added.append(d)
        if deep:
            c.below("a site directory", d, 2)
        for pth, target in pth_lines(d):
            if not target:
                c.path("a .pth file", pth, missing_ok=False)
            else:
                c.path(f"added by {pth}", target)
                if deep and os.path.isdir(target):
                    c.below(f"added by {pth}", target, 2)
    return added


class ImportGuard:
    """First on sys.meta_path: every module found after the start is checked (its file, its
    compiled copy, a package's directories) before it runs, whichever finder found it."""

    def __init__(self, c: Checker) -> None:
        self.c = c

    def find_spec(self, name: str, path: "Sequence[str] | None",
                  target: "ModuleType | None" = None) -> "ModuleSpec | None":
        spec: ModuleSpec | None = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        if spec is None:
            return None
        where = list(spec.submodule_search_locations or [])
        if spec.has_location and spec.origin:
            where.append(spec.origin)
        if spec.cached:
            where.append(spec.cached)  # what Python runs instead of the source, when it is there
        for p in where:
            why = self.c.path(f"module {name}", p)
            if why:
                sys.stderr.write(f"gpuwarden: refusing to import {name}: {why}\n")
                raise ImportError(f"refusing to import {name} as root: {why}", name=name)
        return spec


def check(owners: "Sequence[int]" = ROOT_ONLY, stdlib: "Sequence[str]" = (),
          deep: bool = False) -> Checker:
    """The rule over this interpreter as the hooks start it (-I -S); with ``deep`` every file
    below each directory, gpuwarden's package included. Adds the site directories to sys.path
    (as site.py would) only when all is well."""
    c = Checker(owners)
    guard = ImportGuard(c)
    sys.meta_path.insert(0, guard)  # before anything this file imports (site)
    check_startup(c, stdlib)
    if deep:
        for entry in sys.path:
            if os.path.isdir(entry):
                # Its own site-packages only counts where it is a site directory (below).
                c.below("the standard library", entry, 2, _SITE_NAMES)
    if c.problems:
        return c
    sites = check_sites(c, site_dirs(), deep)
    if c.problems:
        return c
    import site  # noqa: PLC0415

    for d in sites:
        site.addsitedir(d)
    # A .pth line may put a finder of its own first (editable installs do): the guard goes
    # back in front, so that what such a finder finds is checked as well.
    if guard in sys.meta_path:
        sys.meta_path.remove(guard)
    sys.meta_path.insert(0, guard)
    if deep:
        _check_package(c)
    return c


def _check_package(c: Checker) -> None:
    import importlib.util  # noqa: PLC0415 - after the guard: checked as it is imported

    try:
        spec = importlib.util.find_spec("gpuwarden")
    except ImportError:
        return
    for d in list(spec.submodule_search_locations or []) if spec else []:
        c.path("gpuwarden's package", d)
        c.below("gpuwarden's package", d)


def _refused(c: Checker, who: str) -> int:
    for line in c.problems:
        sys.stderr.write(f"{who}: {line}\n")
    sys.stderr.write(f"{who}: refusing to run gpuwarden as root: {c.problems[0]}\n")
    return EXIT_UNTRUSTED


def start(argv: "Sequence[str]") -> int:
    """The hooks' start: HOOK [STDLIB...] (prolog/gpuwarden-hook.sh)."""
    # The wrapper passes the standard libraries it checked one a line, in one argument.
    c = check(ROOT_ONLY, stdlib=[s for a in argv[1:] for s in a.split("\n") if s])
    if c.problems:
        return _refused(c, "gpuwarden")
    try:
        from gpuwarden.hooks.run import main  # noqa: PLC0415
    except Exception as exc:
        sys.stderr.write(f"cannot import gpuwarden.hooks.run: {exc!r}\n")
        return EXIT_UNTRUSTED if c.problems else EXIT_CANNOT_IMPORT
    try:
        code = main(list(argv[:1]))
    except ImportError:
        if not c.problems:
            raise
        return _refused(c, "gpuwarden")
    if c.problems and code != 86:  # a module refused during the run: say so, loudly
        return _refused(c, "gpuwarden")
    return code


def check_main(argv: "Sequence[str]") -> int:
    """--check [--owner UID]: every problem, one a line on stdout; EXIT_UNTRUSTED if any."""
    owners = [0]
    if argv[:1] == ["--owner"] and len(argv) > 1 and argv[1].isdigit():
        owners.append(int(argv[1]))
    c = check(owners, deep=True)
    for line in c.problems:
        sys.stdout.write(line + "\n")
    return EXIT_UNTRUSTED if c.problems else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        sys.exit(check_main(sys.argv[2:]))
    sys.exit(start(sys.argv[1:]))
