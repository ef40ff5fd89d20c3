"""A user can put Xid-looking text into the kernel log (file names, process names, audit records);
none of it may ever drain a node, nor make the check UNKNOWN."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwarden.health import xid
from gpuwarden.health.model import Status

BOOT = 1_700_000_000.0
NOW = BOOT + 10_000
BUS = {"0000:3b:00": 5}
FAKE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."


def kmsg(msg: str, pri: int = 6, secs: float = 9_990) -> str:
    return f"{pri},1,{int(secs * 1e6)},-;{msg}"


def statuses(*lines: str) -> set[Status]:
    log = xid.parse_kmsg("\n".join(lines), BOOT, NOW)
    return {r.status for r in xid.evaluate(log, BUS, NOW, 3600)}


def escape(user_text: str) -> str:
    """What /dev/kmsg does to a record's non-printable characters."""
    return "".join(c if 0x20 <= ord(c) < 0x7F or ord(c) > 0xFF else f"\\x{ord(c):02x}"
                   for c in user_text)


# Real kernel message shapes with user-chosen text where the kernel puts it.
QUOTING = [
    f"traps: {FAKE}[1234] general protection fault ip:401000 sp:7ffd error:0 in a.out[400000+1000]",
    f"python3[4242]: segfault at 0 ip 0000000000401126 sp 00007ffc error 4 in {FAKE}[401000+1000]",
    f'audit: type=1400 audit(1700009990.123:42): apparmor="DENIED" operation="open" '
    f'profile="job" name="/home/u/{FAKE}" pid=4242 comm="python3" requested_mask="r"',
    f"EXT4-fs error (device nvme0n1p1): ext4_lookup:1855: inode #2: comm python3: "
    f"deleted inode referenced: {FAKE}",
    f"audit: type=1300 audit(1700009990.5:43): arch=c000003e syscall=59 success=yes "
    f'exe="/tmp/{FAKE}" comm="NVRM: Xid (PCI:"',
]


@pytest.mark.parametrize("msg", QUOTING)
def test_kernel_messages_quoting_user_text_never_drain(msg: str) -> None:
    assert statuses(kmsg(msg, pri=3)) == {Status.OK}


def test_a_process_named_like_the_driver_prefix_is_neither_an_event_nor_malformed() -> None:
    # TASK_COMM_LEN: a name is at most 15 characters, exactly "NVRM: Xid (PCI:".
    comm = "NVRM: Xid (PCI:"
    assert len(comm) == 15
    assert statuses(kmsg(f"{comm}[4242]: segfault at 0 ip 0000000000401126 sp 0 error 4"),
                    kmsg(f"{comm} (4242) used greatest stack depth: 11 bytes left")) == {Status.OK}


@pytest.mark.parametrize("line", [
    kmsg(FAKE, pri=14),  # facility 1 (user): what a write to /dev/kmsg gets by default
    kmsg(FAKE, pri=(3 << 3) | 3),  # facility 3 (daemon)
    f"<14>[ 9990.000000] {FAKE}",  # dmesg -r
    f"user  :warn  : [ 9990.000000] {FAKE}",  # dmesg -x
    json.dumps({"MESSAGE": FAKE, "_TRANSPORT": "syslog", "SYSLOG_IDENTIFIER": "kernel",
                "SYSLOG_FACILITY": "0", "__REALTIME_TIMESTAMP": str(int((NOW - 10) * 1e6))}),
])
def test_records_outside_the_kernel_facility_never_drain(line: str) -> None:
    log = xid.parse_kmsg(line, BOOT, NOW)
    assert not log.events and not log.malformed and log.not_kernel == 1
    (r,) = xid.evaluate(log, BUS, NOW, 3600)
    assert r.status == Status.OK and "1 driver-like record(s) not from the kernel" in r.message


def test_the_same_line_from_the_kernel_does_drain() -> None:
    assert Status.CRITICAL in statuses(kmsg(FAKE, pri=3))


_TEMPLATES = [
    "{t}[4242]: segfault at 0 ip 0000000000401126 sp 00007ffc error 4 in {u}[401000+1000]",
    "traps: {t}[4242] general protection fault ip:401000 sp:0 error:0 in {u}[400000+1000]",
    'audit: type=1400 audit(1700009990.1:7): apparmor="DENIED" name="{u}" comm="{t}"',
    "EXT4-fs error (device sda1): ext4_lookup:1855: inode #2: comm {t}: bad entry {u}",
    "{t} ({n}): drop_caches: 1",
    "process '{u}' launched '{u}' with NULL argv: empty string added",
]


@settings(max_examples=300, deadline=None)
@given(template=st.sampled_from(_TEMPLATES), comm=st.text(min_size=1, max_size=15),
       user=st.text(max_size=300) | st.sampled_from([FAKE, "NVRM: Xid (0000:3b:00): 48, x",
                                                    "nvidia-nvswitch0: SXid (PCI:0000:05:00.0): "
                                                    "20034, Fatal, Link 1"]),
       pri=st.sampled_from([0, 3, 4, 6, 14]))
def test_no_user_text_in_any_kernel_message_shape_drains_or_goes_unknown(
        template: str, comm: str, user: str, pri: int) -> None:
    msg = template.format(t=escape(comm), u=escape(user), n=4242)
    assert statuses(kmsg(msg, pri=pri)) == {Status.OK}
