"""Reading and replacing the configuration file for `gpuwarden config set`.

The file is read by root's hooks, so it is replaced whole (a new file beside it renamed over
it: a hook never reads half a file), keeps its owner and mode, and is never reached through a
symbolic link (a link someone planted would choose which file root rewrites).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from gpuwarden.core.errors import ConfigError

MAX_BYTES = 1 << 20


def read(path: Path) -> str:
    """The file's text; ConfigError when it is missing, a link, not a regular file or huge."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found: write it first with `gpuwarden "
                          f"config show > {path}`, then set keys in it") from None
    except OSError as exc:
        if os.path.islink(path):
            raise ConfigError(str(path), "", "is a symbolic link: give the file it names "
                              f"(--config {os.path.realpath(path)})") from None
        raise ConfigError(str(path), "", f"cannot read ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ConfigError(str(path), "", "is not a regular file")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        raise ConfigError(str(path), "", f"is larger than {MAX_BYTES} bytes: not a config file")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), "", f"cannot read ({exc})") from None


def replace(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, with the old file's owner and mode."""
    old = os.lstat(path)
    if not stat.S_ISREG(old.st_mode):
        raise ConfigError(str(path), "", "is no longer a regular file: nothing was written")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    created = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        created = True
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), stat.S_IMODE(old.st_mode))
            if os.geteuid() == 0:
                os.fchown(f.fileno(), old.st_uid, old.st_gid)
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if created:
            tmp.unlink(missing_ok=True)
        raise ConfigError(str(path), "", f"cannot write ({exc.strerror}; run it as the file's "
                          "owner, root for /etc/gpuwarden): nothing was written") from None
