"""Re-reading the config file while the placement daemon runs.

The daemon asks every round; the file is read again only when its inode, size or mtime
changed, or after SIGHUP (`systemctl reload gpuwarden-placement`). A file that does not load
is refused with the error that names the key: the daemon keeps running what it had.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from gpuwarden import config as configmod
from gpuwarden.config.placement import PlacementConfig
from gpuwarden.core.configload import to_dict
from gpuwarden.core.errors import ConfigError

StatKey = tuple[int, int, int, int] | None  # (dev, inode, size, mtime_ns); None: no file


@dataclass(frozen=True)
class Reloaded:
    """What a re-read found: new settings to run from the next snapshot, or why not."""

    placement: PlacementConfig | None  # None: refused, the running settings stay
    lemon_file: str = ""
    changed: tuple[str, ...] = ()  # "key: old -> new", keys the daemon uses
    elsewhere: tuple[str, ...] = ()  # changed keys this daemon does not use
    refused: str = ""  # the error, naming the file and the key
    cause: str = "the file changed"
    prom_dir: str = ""  # [health] prom_dir: where its textfile goes ("" = none)


def flatten(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _used(key: str) -> bool:
    """Keys the placement daemon reads: the others need their own command restarted, if any."""
    return key.startswith(("placement.", "slurm.")) or key in ("lemon.list_file",
                                                               "health.prom_dir")


def diff(old: configmod.Config, new: configmod.Config) -> tuple[list[str], list[str]]:
    """(changes the daemon uses as "key: old -> new", other changed keys), sorted by key."""
    a, b = flatten(to_dict(old)), flatten(to_dict(new))
    keys = sorted(k for k in set(a) | set(b) if a.get(k, None) != b.get(k, None))
    used = [f"{k}: {_short(a.get(k, '(unset)'))} -> {_short(b.get(k, '(unset)'))}"
            for k in keys if _used(k)]
    return used, [k for k in keys if not _used(k)]


class Reloader:
    """The real `reload` for daemon.run; ``running`` is the config the daemon started with."""

    def __init__(self, path: Path, running: configmod.Config,
                 stat: Callable[[Path], os.stat_result] = os.stat) -> None:
        self.path = path
        self.running = running
        self._stat = stat
        # Read once more at the first round unless missing (then defaults run, as at start):
        # the file may have changed since the command loaded it.
        self._seen: StatKey = None if self._key() is None else (-2, -2, -2, -2)
        self._asked = False
        self._refused = False

    def request(self) -> None:
        """Re-read at the next round whatever the file's stat says (SIGHUP). Sets a flag
        only: safe in a signal handler."""
        self._asked = True

    def _key(self) -> StatKey:
        try:
            st = self._stat(self.path)
        except FileNotFoundError:
            return None
        except OSError:
            return (-1, -1, -1, -1)  # unreadable: read it, so the error is reported
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def __call__(self) -> Reloaded | None:
        """None when nothing is to be done (the file is as it was, and no SIGHUP came)."""
        forced, self._asked = self._asked, False
        key = self._key()
        if key == self._seen and not forced:
            return None
        self._seen = key
        cause = "SIGHUP" if forced else "the file changed"
        try:
            # configmod.load would take a removed default file for all defaults: refused here.
            text = self.path.read_text(encoding="utf-8")
            new = configmod.parse(text, str(self.path))
        except ConfigError as exc:
            return self._refuse(str(exc), cause)
        except FileNotFoundError:
            return self._refuse(f"{self.path}: file not found (removed?)", cause)
        except (OSError, UnicodeDecodeError) as exc:
            return self._refuse(f"{self.path}: cannot read ({exc})", cause)
        used, elsewhere = diff(self.running, new)
        if not (used or elsewhere or forced or self._refused):
            return None  # touched, or rewritten as it was
        self.running, self._refused = new, False
        return Reloaded(new.placement, new.lemon.list_file, tuple(used), tuple(elsewhere),
                        cause=cause, prom_dir=new.health.prom_dir)

    def _refuse(self, why: str, cause: str) -> Reloaded:
        self._refused = True
        return Reloaded(None, refused=why, cause=cause)


def install_sighup(reloader: Reloader) -> Any:
    """SIGHUP asks ``reloader`` to re-read; returns the handler it replaced."""
    def on_hup(signum: int, frame: FrameType | None) -> None:
        reloader.request()

    return signal.signal(signal.SIGHUP, on_hup)
