"""safefs: every file root opens, reads or writes next to what users control. Import from here,
not from the submodules.

Every entry point given a path reaches its directory by one walk from / (_walk: each
component by its parent's descriptor, ``O_DIRECTORY|O_NOFOLLOW``; every directory on the way
root's or the expected owner's and writable by nobody else, a sticky one only when root's; a
link on the way followed only when root's in a directory of root's, at most 40 hops; the named
directory never a link). The file is then opened by that descriptor without following a link
(``O_NOFOLLOW``), never waiting on a FIFO (``O_NONBLOCK``, then ``fstat``: regular files only),
and its owner checked on reads as on writes. What each entry point refuses is one table:
tests/unit/test_safefs_refusals.py (a strict xfail there is a known gap; there are none). The
submodules differ in whose files they are and what a refusal tells the operator to do:

- privfile: root's own state read back (the verdict, the prolog's settings): `read_private`,
  `read_own_at`, `check_private_dir`, `open_private_dir` (its descriptor, for a writer that
  works in it by descriptor: the accounting store), `unsafe_dir_problem`; raises
  `StateDirError`.
- atomic: root's state and metrics written (complete or absent, never through a link):
  `ensure_private_dir`, `atomic_write`, `write_at`, `discard`, `read_plain`,
  `open_trusted_dir` (root's or ours, for readers by descriptor: the accounting store).
- adminfile: a file a root-run filter trusts (the placement snapshot job_submit.lua reads):
  `write_admin_file`, `admin_file_problem`, `read_head`; raises `UnsafePathError`.
- installwrite: install-files (and `health inject`) walking from / to where root writes:
  `opened_dir`, `read_existing`, `already_installed`, `read_source`; raises
  gpuwarden.core.errors.InstallError.
- spool: the checkpoint spool other users write in: `open_spool`, `ensure_spool`, `walk`,
  `open_dir`, `read_file`, `copy_file`, `map_file`, `stream_file`, `remove_at`, `lstat_at`;
  raises `Refused`.
- _checks: the checks those share (the open flags, a directory's type, owner and mode).
- _walk: the walk from / those share (`walk_dir`), raising `Unsafe`, which each re-raises.

The submodules load on first use of one of their names: the prolog's fast gate imports
`read_private` and must not pay for the spool's (or contextlib's) imports.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing costs the fast gate milliseconds (see gpuwarden.health.fastgate)
if TYPE_CHECKING:
    from gpuwarden.core.safefs._checks import DIR_FLAGS, FILE_FLAGS
    from gpuwarden.core.safefs.adminfile import (
        UnsafePathError,
        admin_file_problem,
        read_head,
        write_admin_file,
    )
    from gpuwarden.core.safefs.atomic import (
        atomic_write,
        discard,
        ensure_private_dir,
        open_trusted_dir,
        read_plain,
        write_at,
    )
    from gpuwarden.core.safefs.installwrite import (
        already_installed,
        opened_dir,
        read_existing,
        read_source,
    )
    from gpuwarden.core.safefs.privfile import (
        MAX_STATE_BYTES,
        StateDirError,
        check_private_dir,
        open_private_dir,
        read_own_at,
        read_private,
        unsafe_dir_problem,
    )
    from gpuwarden.core.safefs.spool import (
        Refused,
        closing,
        copy_file,
        ensure_spool,
        lstat_at,
        map_file,
        mappable,
        open_dir,
        open_spool,
        read_file,
        remove_at,
        stream_file,
        walk,
    )

# Each public name and the submodule that defines it (a test holds this equal to __all__ and
# to the imports above).
_HOME = {
    "DIR_FLAGS": "_checks", "FILE_FLAGS": "_checks",
    "MAX_STATE_BYTES": "privfile", "StateDirError": "privfile",
    "check_private_dir": "privfile", "open_private_dir": "privfile", "read_own_at": "privfile",
    "read_private": "privfile", "unsafe_dir_problem": "privfile",
    "atomic_write": "atomic", "discard": "atomic", "ensure_private_dir": "atomic",
    "open_trusted_dir": "atomic", "read_plain": "atomic", "write_at": "atomic",
    "UnsafePathError": "adminfile", "admin_file_problem": "adminfile", "read_head": "adminfile",
    "write_admin_file": "adminfile",
    "already_installed": "installwrite", "opened_dir": "installwrite",
    "read_existing": "installwrite", "read_source": "installwrite",
    "Refused": "spool", "closing": "spool", "copy_file": "spool", "ensure_spool": "spool",
    "lstat_at": "spool", "map_file": "spool", "mappable": "spool", "open_dir": "spool",
    "open_spool": "spool", "read_file": "spool", "remove_at": "spool", "stream_file": "spool",
    "walk": "spool",
}

__all__ = [
    "DIR_FLAGS",
    "FILE_FLAGS",
    "MAX_STATE_BYTES",
    "Refused",
    "StateDirError",
    "UnsafePathError",
    "admin_file_problem",
    "already_installed",
    "atomic_write",
    "check_private_dir",
    "closing",
    "copy_file",
    "discard",
    "ensure_private_dir",
    "ensure_spool",
    "lstat_at",
    "map_file",
    "mappable",
    "open_dir",
    "open_private_dir",
    "open_spool",
    "open_trusted_dir",
    "opened_dir",
    "read_existing",
    "read_file",
    "read_head",
    "read_own_at",
    "read_plain",
    "read_private",
    "read_source",
    "remove_at",
    "stream_file",
    "unsafe_dir_problem",
    "walk",
    "write_admin_file",
    "write_at",
]


def __getattr__(name: str) -> object:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    # __import__, not importlib: importlib's package costs the fast gate its imports.
    value = getattr(__import__(f"{__name__}.{home}", fromlist=[name]), name)
    globals()[name] = value  # once: later lookups (and monkeypatch) see a plain attribute
    return value
