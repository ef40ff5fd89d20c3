"""Kernel-log renderings are read, not rejected; the file they come in must be root's own."""

import os
import time
from pathlib import Path

import pytest

from gpuwarden.health import gather, kernlog, xid
from gpuwarden.health.model import Status

BOOT = 1_700_000_000.0
NOW = BOOT + 10_000
XID79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."


def test_dmesg_times_count_from_boot_and_dmesg_t_from_the_wall_clock() -> None:
    stamp = time.strftime("%a %b %e %H:%M:%S %Y", time.localtime(NOW - 5))
    recs = kernlog.parse(f"[ 9990.500000] {XID79}\n[{stamp}] {XID79}", BOOT, NOW).records
    assert [r.at for r in recs] == [BOOT + 9990.5, pytest.approx(NOW - 5)]
    assert all(r.kernel and r.text == XID79 for r in recs)


def test_syslog_assumes_the_year_that_is_not_in_the_future() -> None:
    # Written on 2 January about 31 December: last year's record, not next December's.
    now = time.mktime((2025, 1, 2, 12, 0, 0, 0, 0, -1))
    (rec,) = kernlog.parse(f"Dec 31 23:59:00 gpu01 kernel: {XID79}", BOOT, now).records
    assert time.localtime(rec.at).tm_year == 2024 and rec.kernel


def test_the_syslog_tag_decides_kernel_origin_and_uptime_prefixes_are_stripped() -> None:
    text = (f"Mar  4 10:00:00 gpu01 kernel: [ 12.000001] {XID79}\n"
            f"Mar  4 10:00:01 gpu01 myjob[77]: {XID79}")
    kern, user = kernlog.parse(text, BOOT, NOW).records
    assert kern.kernel and kern.text == XID79 and not user.kernel


def test_kmsg_continuation_fragments_join_their_record() -> None:
    text = "3,1,5000000,c;NVRM: Xid (PCI:0000:3b:00): 79, pid=1,\n3,2,5000001,+; GPU has fallen off\n"
    (rec,) = kernlog.parse(text, BOOT, NOW).records
    assert rec.text.endswith("pid=1, GPU has fallen off")


def _log_file(tmp_path: Path, text: str, mode: int) -> Path:
    p = tmp_path / "kern.log"
    p.write_text(text)
    p.chmod(mode)
    return p


def test_a_saved_log_file_is_read_in_its_rendering(tmp_path: Path) -> None:
    p = _log_file(tmp_path, f"[ 9990.000000] {XID79}\n", 0o644)
    text, booted = gather.read_kernel_log(str(p))
    log = xid.parse_kernel_log(text, BOOT, NOW)
    (r,) = xid.evaluate(log, {"0000:3b:00": 5}, NOW, 3600)
    assert r.status == Status.CRITICAL and r.gpu == 5 and booted > 0


def test_a_log_file_others_can_write_is_refused(tmp_path: Path) -> None:
    p = _log_file(tmp_path, f"[ 9990.000000] {XID79}\n", 0o666)
    with pytest.raises(OSError, match="writable by group or others"):
        gather.read_kernel_log(str(p))


def test_a_link_or_a_fifo_is_refused_without_hanging(tmp_path: Path) -> None:
    target = _log_file(tmp_path, "", 0o644)
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(OSError):
        gather.read_kernel_log(str(link))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(OSError, match="not a regular file"):
        gather.read_kernel_log(str(fifo))
