"""Issue 11 items 1-2 in the real cluster: Xid text a user controls never drains a node; the
driver's MIG format and NVSwitch SXids do, through HealthCheckProgram, from the renderings no user
can forge lines in (kmsg, journalctl -o json); a forgeable rendering (dmesg) never drains."""

from __future__ import annotations

import json
import time

import pytest

from devcluster.harness import Harness
from tests.e2e.test_foundation import sinfo_reasons
from tests.e2e.test_health import clean, periodic  # noqa: F401 - the fixture is used by name

pytestmark = pytest.mark.timeout(300)
FAKE79 = "NVRM: Xid (PCI:0000:68:00): 79, pid=1, name=x, GPU has fallen off the bus."


def uptime(h: Harness, node: str) -> float:
    return float(h.exec(node, ["cat", "/proc/uptime"]).check("uptime").out.split()[0])


def test_user_controlled_xid_text_never_drains(clean: Harness) -> None:  # noqa: F811
    h = clean
    usec = int(uptime(h, "c5") * 1e6)
    lines = [
        f"6,1,{usec},-;python3[4242]: segfault at 0 ip 0000000000401126 sp 0 error 4 "
        f"in {FAKE79}[401000+1000]",
        f"6,2,{usec},-;NVRM: Xid (PCI:[4243]: segfault at 0 ip 0000000000401126 sp 0 error 4",
        f'5,3,{usec},-;audit: type=1400 audit(1.1:42): apparmor="DENIED" name="/tmp/{FAKE79}"',
        f"14,4,{usec},-;{FAKE79}",  # facility user
    ]
    h.write_fake("c5", "kmsg", "\n".join(lines) + "\n")
    periodic(h, "c5")
    assert "c5" not in sinfo_reasons(h)
    out = h.gpuwarden("c5", "health", "check").out
    assert "not from the kernel ignored" in out and "malformed" not in out


def test_mig_format_in_kmsg_rendering_drains_by_its_own_rst_flag(clean: Harness) -> None:  # noqa: F811
    h = clean
    usec = int(uptime(h, "c6") * 1e6)
    line = (f"3,1,{usec},-;NVRM: Xid (PCI:0000:68:00 GPU-I:05): 94, pid=7194, "
            f"Contained: CE User Channel (0x9). RST: Yes, D-RST: No\n")
    h.write_fake("c6", "kmsg", line)
    periodic(h, "c6")
    reason = sinfo_reasons(h).get("c6", "")
    assert reason.startswith("gpuwarden: periodic: xid 94 on GPU 5") and "needs GPU reset" in reason


def test_fatal_xid_in_a_forgeable_dmesg_rendering_never_drains_and_says_why(clean: Harness) -> None:  # noqa: F811
    """In dmesg's rendering any user can forge a kernel line (a newline in a file name): the
    XID is reported as a warning, gating says it is degraded, and no node drains."""
    h = clean
    line = (f"[{uptime(h, 'c6'):12.6f}] NVRM: Xid (PCI:0000:68:00 GPU-I:05): 94, pid=7194, "
            f"Contained: CE User Channel (0x9). RST: Yes, D-RST: No\n")
    h.write_fake("c6", "kmsg", line)
    periodic(h, "c6")
    assert "c6" not in sinfo_reasons(h)
    out = h.gpuwarden("c6", "health", "check").out
    assert "not drain evidence" in out and "XID drains off" in out and "/dev/kmsg" in out


def test_fatal_sxid_in_journal_json_drains(clean: Harness) -> None:  # noqa: F811
    h = clean
    now_us = str(int(time.time() * 1e6))
    recs = [json.dumps({"MESSAGE": f"nvidia-nvswitch0: SXid (PCI:0000:05:00.0): 20034, {rest}",
                        "_TRANSPORT": "kernel", "__REALTIME_TIMESTAMP": now_us})
            for rest in ("Fatal, Link 60 LTSSM Fault Up",
                         "Severity 1 Engine instance 60 Sub-engine instance 00")]
    h.write_fake("c7", "kmsg", "\n".join(recs) + "\n")
    periodic(h, "c7")
    assert sinfo_reasons(h).get("c7", "").startswith(
        "gpuwarden: periodic: sxid 20034 on NVSwitch 0000:05:00")
