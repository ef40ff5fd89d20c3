"""Every format the driver prints, in every rendering admins save, judged by NVIDIA's catalog."""

import json
import time
from datetime import datetime

import pytest

from gpuwarden.health import xid, xidpolicy
from gpuwarden.health.model import Status
from gpuwarden.health.xidcatalog import CATALOG

BOOT = 1_700_000_000.0
NOW = BOOT + 10_000
AT = NOW - 10
BUS = {"0000:68:00": 5}

FORMATS = [
    "NVRM: Xid (PCI:0000:68:00): {n}, pid=42, name=python, {text}",
    "NVRM: Xid (PCI:0000:68:00): {n}, pid='<unknown>', name=<unknown>, {text}",
    "NVRM: Xid (PCI:0000:68:00): {n}, {text}",
    "NVRM: Xid (0000:68:00): {n}, {text}",  # older drivers, as in NVIDIA's own docs
    "NVRM: Xid (PCI:0000:68:00 GPU-I:05): {n}, pid=7194, {text}",  # MIG
    "NVRM: Xid (PCI:0000:68:00 GPU-I:05 GPU-CI:01): {n}, pid=7194, name=python, {text}",
]


def _local(fmt: str) -> str:
    return time.strftime(fmt, time.localtime(AT))


RENDERINGS = {
    "kmsg": lambda m: f"3,7,{int((AT - BOOT) * 1e6)},-;{m}",
    "dmesg": lambda m: f"[{AT - BOOT:12.6f}] {m}",
    "dmesg -T": lambda m: f"[{_local('%a %b %e %H:%M:%S %Y')}] {m}",
    "dmesg -r": lambda m: f"<3>[{AT - BOOT:12.6f}] {m}",
    "dmesg -x": lambda m: f"kern  :err   : [{AT - BOOT:12.6f}] {m}",
    "syslog": lambda m: f"{_local('%b %e %H:%M:%S')} gpu01 kernel: [{AT - BOOT:.6f}] {m}",
    "journalctl": lambda m: f"{_local('%b %d %H:%M:%S')} gpu01 kernel: {m}",
    "journalctl -o short-iso": lambda m: (
        f"{datetime.fromtimestamp(AT).astimezone().isoformat(timespec='seconds')} gpu01 kernel: {m}"),
    "journalctl -o json": lambda m: json.dumps(
        {"MESSAGE": m, "_TRANSPORT": "kernel", "__REALTIME_TIMESTAMP": str(int(AT * 1e6))}),
    # Renderings the review found silently ignored or rejected as malformed.
    "journalctl -o short-monotonic": lambda m: f"[{AT - BOOT:12.6f}] gpu01 kernel: {m}",
    "journalctl -o short-precise": lambda m: f"{_local('%b %d %H:%M:%S')}.123456 gpu01 kernel: {m}",
    "journalctl -o short-iso-precise": lambda m: (
        f"{_local('%Y-%m-%dT%H:%M:%S')}.123456{_local('%z')} gpu01 kernel: {m}"),
    "journalctl -o short-full": lambda m: f"{_local('%a %Y-%m-%d %H:%M:%S %Z')} gpu01 kernel: {m}",
    "dmesg (CONFIG_PRINTK_CALLER)": lambda m: f"[{AT - BOOT:12.6f}] [ T1234] {m}",
    "syslog imklog (CONFIG_PRINTK_CALLER)": lambda m: (
        f"{_local('%b %e %H:%M:%S')} gpu01 kernel: [{AT - BOOT:.6f}][ T1234] {m}"),
    "dmesg --time-format iso": lambda m: f"{_dmesg_iso()} {m}",
    "dmesg -x --time-format iso": lambda m: f"kern  :err   : {_dmesg_iso()} {m}",
    "dmesg -d": lambda m: f"[{AT - BOOT:12.6f} <    0.000123>] {m}",
    "RFC 5424": lambda m: (
        f"<3>1 {time.strftime('%Y-%m-%dT%H:%M:%S', time.gmtime(AT))}.000Z gpu01 kernel - - - {m}"),
}


def _dmesg_iso() -> str:
    return datetime.fromtimestamp(AT).astimezone().isoformat(timespec="microseconds").replace(
        ".", ",")

FATAL_BUCKETS = {"RESET_GPU", "RESTART_BM", "RESTART_VM", "WORKFLOW_XID_48",
                 "WORKFLOW_NVLINK_ERR", "CHECK_MECHANICALS"}
FATAL = sorted(c for c, (_, bucket) in CATALOG.items() if bucket in FATAL_BUCKETS)
INFORMATIONAL = sorted(c for c, (_, bucket) in CATALOG.items()
                       if bucket in {"IGNORE", "RESTART_APP", "WORKFLOW_XID_45"} and c != 94)


def judge(*lines: str) -> list:
    return xid.evaluate(xid.parse_kernel_log("\n".join(lines), BOOT, NOW), BUS, NOW, 3600)


def test_the_catalog_lists_the_codes_the_issue_names_as_fatal() -> None:
    for code in (46, 48, 62, 64, 74, 79, 95, 109, 110, 119, 120, 136, 140, 143, 151, 155, 156, 158):
        assert code in FATAL, code


@pytest.mark.parametrize("rendering", sorted(RENDERINGS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_fatal_catalog_code_drains_in_every_format_and_rendering(fmt: str,
                                                                       rendering: str) -> None:
    for code in FATAL:
        line = RENDERINGS[rendering](fmt.format(n=code, text="some driver text."))
        results = judge(line)
        assert [r.status for r in results] == [Status.CRITICAL], (code, line, results)
        assert results[0].gpu == 5 and results[0].evidence.startswith(f"xid {code} on GPU 5")


@pytest.mark.parametrize("fmt", FORMATS)
def test_informational_codes_never_drain(fmt: str) -> None:
    for code in INFORMATIONAL:
        results = judge(RENDERINGS["kmsg"](fmt.format(n=code, text="whatever.")))
        assert all(r.status != Status.CRITICAL for r in results), (code, results)


def test_every_catalog_code_has_a_policy_with_the_catalog_beside_it() -> None:
    assert set(CATALOG) <= set(xidpolicy.POLICY)
    assert len(CATALOG) == 172
    for code, (_, bucket) in CATALOG.items():
        assert xidpolicy.POLICY[code].catalog == bucket


def test_docs_carry_the_policy_table_and_its_version() -> None:
    with open("docs/health.md", encoding="utf-8") as f:
        docs = f.read()
    assert xidpolicy.policy_table_markdown() in docs
    assert xidpolicy.POLICY_VERSION in docs
    for code in xidpolicy.OVERRIDES:
        assert f"* **{code}** (" in docs


@pytest.mark.parametrize(("text", "status", "suffix"), [
    ("GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
     Status.CRITICAL, "needs GPU reset"),
    ("GPU recovery action changed from 0x0 (None) to 0x4 (Drain and Reset)",
     Status.CRITICAL, "needs GPU reset"),
    ("GPU recovery action changed from 0x0 (None) to 0x2 (Node Reboot Required)",
     Status.CRITICAL, "needs node reboot"),
    ("GPU recovery action changed from 0x0 (None) to 0x3 (Drain P2P)", Status.WARNING, ""),
])
def test_154_follows_the_recovery_action_it_names(text: str, status: Status, suffix: str) -> None:
    (r,) = judge(RENDERINGS["kmsg"](f"NVRM: Xid (PCI:0000:68:00): 154, {text}"))
    assert r.status == status and r.evidence.endswith(suffix)


def test_a_later_154_back_to_none_clears_the_earlier_one() -> None:
    lines = [f"3,{i},{int((AT - BOOT + i) * 1e6)},-;NVRM: Xid (PCI:0000:68:00): 154, GPU recovery "
             f"action changed from {a}" for i, a in enumerate(
                 ["0x0 (None) to 0x1 (GPU Reset Required)", "0x1 (GPU Reset Required) to 0x0 (None)"])]
    assert [r.status for r in judge(*lines)] == [Status.OK]


@pytest.mark.parametrize(("body", "status"), [
    ("149, NETIR_LINK_EVT  Fatal   XC0 i0 Link 09 (0x025525c6 0x00000000 0x00000000 0x00000000 "
     "0x00000000 0x00000000)", Status.CRITICAL),  # link down, peer device: reset
    ("149, NETIR_LINK_EVT Fatal XC0 i0 Link 00 (0x026001c6 0x00000000 0x00000000 0x00000000 "
     "0x00000000 0x00000000)", Status.OK),  # link taken down by software: the catalog ignores it
    ("149, NETIR_LINK_EVT/NETIR_LINK_DOWN Fatal XC0 i0 Link 00 (0x01000011 0x00000000 0x00000000 "
     "0x00000000)", Status.CRITICAL),  # R575 layout
    ("149, NETIR_MFDE_EVENT Nonfatal XC0 i0 Link 00 (0x00000014 0x00000003 0x00000000 0x00000000)",
     Status.OK),
    ("149, NETIR_MFDE_EVENT Fatal XC0 i0 Link 00 (0x00000014 0x00000001 0x00000000 0x00000000)",
     Status.CRITICAL),
    ("144, SAW_MVB Fatal XC0 i0 Link -1 (0x00000021 0x00000002 0x0 0x0 0x0 0x0)", Status.CRITICAL),
    ("144, SAW_MVB Nonfatal XC0 i0 Link -1 (0x00000021 0x00000001 0x0 0x0 0x0 0x0)", Status.OK),
    ("146, TLW_RX_PIPE0 Fatal XC0 i0 Link 03 (0x0000000a 0x00000004 0x0 0x0)", Status.CRITICAL),
    ("145, RLW_REMAP Nonfatal XC0 i0 Link 03 (0x00000004 0x00000001 0x0 0x0)", Status.WARNING),
    ("145, RLW_RXPIPE Nonfatal XC0 i0 Link 03 (0x00000086 0x00000001 0x0 0x0)", Status.CRITICAL),
    ("145, RLW_RXPIPE Nonfatal XC0 i0 Link 03 (0x00000006 0x00000001 0x0 0x0)", Status.OK),
    ("150, MSE_WATCHDOG Fatal XC0 i0 Link -1 (0x00000000 0x00000000)", Status.CRITICAL),
    ("147, TREX Fatal XC0 i0 Link 02 (0x0000000e 0x00000077)", Status.CRITICAL),  # unlisted: fatal word
    ("148, something the decode table has never seen", Status.WARNING),
])
def test_nvlink5_xids_are_decoded(body: str, status: Status) -> None:
    results = judge(RENDERINGS["kmsg"](f"NVRM: Xid (PCI:0000:68:00): {body}"))
    assert [r.status for r in results] == [status], results


SXID = "nvidia-nvswitch{sw}: SXid (PCI:0000:0{sw}:00.0): {code}, {rest}"


@pytest.mark.parametrize("code", [20034, 24007])
def test_fatal_sxids_drain_once_with_their_follow_up_records(code: int) -> None:
    lines = [f"3,{i},{int((AT - BOOT) * 1e6) + i},-;" + SXID.format(sw=5, code=code, rest=rest)
             for i, rest in enumerate(["Fatal, Link 60 LTSSM Fault Up",
                                       "Severity 1 Engine instance 60 Sub-engine instance 00",
                                       "Data {0x0000003c, 0x0000003c, 0x00000000, 0x80000302}"])]
    (r,) = judge(*lines)
    assert r.status == Status.CRITICAL and r.gpu is None
    assert r.evidence.startswith(f"sxid {code} on NVSwitch 0000:05:00") and "x in" not in r.evidence


def test_non_fatal_sxids_do_not_drain() -> None:
    line = RENDERINGS["dmesg"](SXID.format(sw=3, code=12028,
                                           rest="Non-fatal, Link 32 egress non-posted PRIV error"))
    assert [r.status for r in judge(line)] == [Status.OK]


def test_records_of_one_event_count_once() -> None:
    def line(i: int, secs: float) -> str:
        return f"3,{i},{int(secs * 1e6)},-;NVRM: Xid (PCI:0000:68:00): 92, pid=1, High SBE rate"
    one_burst = [line(i, 9_000 + i / 100) for i in range(20)]  # 20 records within 0.2 s
    assert [r.status for r in judge(*one_burst)] == [Status.WARNING]
    separate = [line(i, 7_000 + 5 * i) for i in range(20)]
    assert [r.status for r in judge(*separate)] == [Status.CRITICAL]


def test_records_from_an_earlier_boot_in_a_saved_syslog_do_not_count() -> None:
    # A syslog file spans reboots: a fatal Xid from before this boot is history, not this boot's.
    older = BOOT - 86_400 * 3
    stamp = time.strftime("%b %e %H:%M:%S", time.localtime(older))
    assert [r.status for r in judge(f"{stamp} gpu01 kernel: NVRM: Xid (PCI:0000:68:00): 79, x")] \
        == [Status.OK]


def test_other_programs_lines_in_a_syslog_file_are_not_malformed() -> None:
    lines = [f"{_local('%b %e %H:%M:%S')} gpu01 sshd[812]: Accepted publickey for root",
             f"{_local('%b %e %H:%M:%S')} gpu01 kernel: usb 1-1: new high-speed USB device"]
    log = xid.parse_kernel_log("\n".join(lines), BOOT, NOW)
    assert not log.malformed and not log.events
