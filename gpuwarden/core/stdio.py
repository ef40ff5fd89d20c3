"""Forked check children must not hold their parent's stdin/stdout/stderr.

A child stuck in the kernel (D state: a hung NFS mount, a wedged GPU driver) cannot be killed
and outlives the hook. Holding the hook's stdout or stderr, it keeps whatever reads them
(the sh wrapper's capture, slurmd) waiting until the kernel lets go. Standard library only:
the prolog's fast path imports this.
"""

from __future__ import annotations

import os


def quiet_stdio() -> None:
    """Point fds 0, 1 and 2 at /dev/null (in a forked child, before its work starts); the
    child's own result pipe is another fd and stays open."""
    fd = os.open(os.devnull, os.O_RDWR)
    try:
        for target in (0, 1, 2):
            if fd != target:
                os.dup2(fd, target)
    finally:
        if fd > 2:
            os.close(fd)
