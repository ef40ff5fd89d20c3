"""The hostile review of the kernel-log XID parser (issue 11, items 1-8): each reproduction."""

import json
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.health import fastgate, kernlog, kernlogtrust, xid
from gpuwarden.health.model import Status

BOOT = 1_700_000_000.0
NOW = BOOT + 10_000
BUS = {"0000:3b:00": 5, "0000:01:00": 0}
FAKE = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=x, GPU has fallen off the bus."


def kmsg(msg: str, pri: int = 3, secs: float = 9_990) -> str:
    return f"{pri},1,{int(secs * 1e6)},-;{msg}"


def judge(text: str, now: float = NOW, boot: float = BOOT) -> list:
    return xid.evaluate(xid.parse_kernel_log(text, boot, now), BUS, now, 3600)


def statuses(text: str, now: float = NOW) -> set[Status]:
    return {r.status for r in judge(text, now)}


# --- 1: lines split on "\n" only ----------------------------------------------------------

@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x85", "\x1c", "\x1d", "\x1e", "\x0b",
                                 "\x0c", "\r"])
def test_a_file_name_with_a_line_separator_cannot_start_a_forged_kernel_line(sep: str) -> None:
    stamp = time.strftime("%b %d %H:%M:%S", time.localtime(NOW - 30))
    seg = (f"{stamp} h kernel: a.out[4242]: segfault at 0 ip 0 sp 0 error 4 in x{sep}"
           f"{stamp} h kernel: {FAKE}[401000+1000]")
    assert statuses(seg) == {Status.OK}
    assert len(kernlog.parse(seg, BOOT, NOW).records) == 1


# --- 1: renderings a user can forge lines in are refused before the hooks run ---------------

def _stamp() -> str:
    return time.strftime("%b %d %H:%M:%S", time.localtime(NOW - 30))


@pytest.mark.parametrize("text", [
    # the kernel's syslog interface repeats "<pri>[time]" after a newline in a file name
    "<3>[ 9990.000000] a.out[4242]: segfault at 0 in x\n<3>[ 9990.000000] " + FAKE,
    "[ 9990.000000] a.out[4242]: segfault at 0 in x\n[ 9990.000000] " + FAKE,
    f"{_stamp()} gpu01 kernel: {FAKE}",  # logger -t kernel
    f"2023-11-14T22:13:10+0000 gpu01 kernel: {FAKE}",
    f"<3>1 2023-11-14T22:13:10.000Z gpu01 kernel - - - {FAKE}",
])
def test_forgeable_renderings_are_refused_with_the_fix(text: str) -> None:
    why = kernlogtrust.problem("/var/log/kern.log", text)
    assert "any user can forge" in why and "/dev/kmsg" in why and "journalctl -k -o json" in why


def test_kmsg_and_journal_json_are_trusted() -> None:
    doc = {"MESSAGE": FAKE, "_TRANSPORT": "kernel", "__REALTIME_TIMESTAMP": "1"}
    assert kernlogtrust.problem("/var/log/kern.json", json.dumps(doc)) == ""
    assert kernlogtrust.problem("/var/log/kmsg.saved", kmsg(FAKE)) == ""
    assert kernlogtrust.problem("/dev/kmsg", "anything") == ""


def test_a_file_where_no_line_parses_is_refused_loudly(tmp_path: Path) -> None:
    why = kernlogtrust.problem("/x", f"[Jan 1 10:00] {FAKE}\n[  +0.000123] {FAKE}")
    assert "no line is a kernel log record" in why and "dmesg -e" in why
    p = tmp_path / "kern.log"
    p.write_text("total garbage\n")
    p.chmod(0o644)
    readable, why = kernlogtrust.check_file(str(p), 5)
    assert readable and "no line is a kernel log record" in why
    readable, why = kernlogtrust.check_file(str(tmp_path / "absent"), 5)
    assert not readable and why


# --- 2: no user can make the check UNKNOWN ---------------------------------------------------

def _escape(raw: bytes) -> str:
    return "".join(chr(c) if 0x20 <= c < 0x7F and c != 0x5C else f"\\x{c:02x}" for c in raw)


@pytest.mark.parametrize("msg", [
    _escape("NVRM: Xid é".encode()[:15]) + "[4242]: segfault at 0 ip 0 sp 0 error 4 in a.out",
    "NVRM: Xid (PCI: invoked oom-killer: gfp_mask=0xcc0(GFP_KERNEL), order=0, oom_score_adj=0",
    "NVRM: Xid: page allocation failure: order:10, mode:0x40cc0(GFP_KERNEL|__GFP_COMP)",
    "nvidia-nvswitch0: SXid (PCI:zz invoked oom-killer: gfp_mask=0xcc0",
])
def test_records_with_the_prefix_but_not_the_drivers_shape_are_counted_not_unknown(
        msg: str) -> None:
    log = xid.parse_kernel_log(kmsg(msg, pri=4), BOOT, NOW)
    assert not log.malformed and log.unshaped == 1
    (r,) = xid.evaluate(log, BUS, NOW, 3600)
    assert r.status == Status.OK and "not its shape" in r.message


# --- 3: 154 by its numeric recovery action ---------------------------------------------------

@pytest.mark.parametrize(("action", "status", "needs"), [
    ("0x2 (OS Reboot)", Status.CRITICAL, "needs node reboot"),
    ("0x1 (PF FLR)", Status.CRITICAL, "needs GPU reset"),
    ("0x4 (Drain and Reset)", Status.CRITICAL, "needs GPU reset"),
    ("0x3 (Drain P2P)", Status.WARNING, ""),
    ("0x7 (Something New)", Status.CRITICAL, "needs GPU reset"),
    ("0x0 (None)", Status.OK, ""),
])
def test_154_follows_nvmls_numeric_recovery_action(action: str, status: Status,
                                                   needs: str) -> None:
    (r,) = judge(kmsg("NVRM: Xid (PCI:0000:01:00): 154, GPU recovery action changed from "
                      f"0x0 (None) to {action}"))
    assert r.status == status and needs in r.message


# --- 5: kmsg records ahead of the wall clock still count -------------------------------------

def test_a_kmsg_record_ahead_of_the_wall_clock_still_drains() -> None:
    assert statuses(kmsg(FAKE, secs=NOW - BOOT + 600)) == {Status.CRITICAL}


def test_a_saved_syslog_record_far_in_the_future_still_does_not_count() -> None:
    stamp = time.strftime("%b %d %H:%M:%S", time.localtime(NOW + 3600))
    assert statuses(f"{stamp} gpu01 kernel: {FAKE}") == {Status.OK}


# --- 6: every regex linear in the line's length -----------------------------------------------

def test_long_hostile_lines_parse_in_linear_time() -> None:
    lines = [kmsg("NVRM: Xid (PCI:0000:01:00): 149, " + "A Fatal " * (8 << 10), pri=6),
             kmsg("NVRM: Xid (PCI:0000:01:00): 154, " + "recovery action changed from " * 2000),
             kmsg("NVRM: Xid (PCI:0000:01:00): 94, " + "RST: Yes " * 5000)]
    start = time.monotonic()
    for _ in range(20):
        judge("\n".join(lines))
    assert time.monotonic() - start < 2.0  # quadratic: about 3 s per 64 KiB line


# --- 7: event merging, orphans, 94's own flags -------------------------------------------------

def test_92_records_less_than_a_second_apart_still_reach_the_threshold() -> None:
    text = "\n".join(kmsg("NVRM: Xid (PCI:0000:01:00): 92, High single-bit ECC error rate",
                          secs=9_000 + i * 0.9) for i in range(100))
    assert statuses(text) == {Status.CRITICAL}


def test_orphan_sxid_follow_up_records_are_ignored() -> None:
    s = "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 24007, "
    assert statuses(kmsg(s + "Data {0x00000000}") + "\n"
                    + kmsg(s + "Severity 5 Engine instance 0 Sub-engine instance 00")) == {Status.OK}


def test_94_without_the_drivers_flags_is_not_decided_by_the_process_name() -> None:
    (r,) = judge(kmsg("NVRM: Xid (PCI:0000:01:00): 94, pid=1234, name=RST: Yes, "
                      "Contained: SM (0x1)"))
    assert r.status == Status.WARNING


# --- 8: nits ----------------------------------------------------------------------------------

def test_a_fatal_sxid_names_its_reset_once() -> None:
    s = "nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 20034, Fatal, Link 30 LTSSM Fault Up"
    (r,) = judge(kmsg(s))
    assert r.status == Status.CRITICAL and r.message.count("reset") == 1


@pytest.mark.parametrize(("msg", "driver"), [
    (b"nvidia-smi[4242]: segfault at 0 ip 0 sp 0 error 4 in libnvidia-ml.so", False),
    (b"nvidia-persiste[77]: segfault at 0", False),
    (b"nvidiafoo: page allocation failure", False),
    (b"NVRM: Xid (PCI:0000:18:00): 79, pid=1, fell off", True),
    (b"nvidia-nvswitch3: SXid (PCI:0000:04:00.0): 20034, Fatal", True),
    (b"nvidia-modeset: Loading NVIDIA Kernel Mode Setting Driver", True),
    (b"nvidia 0000:3b:00.0: enabling device (0000 -> 0003)", True),
])
def test_the_fast_path_counts_only_the_drivers_own_records(msg: bytes, driver: bool) -> None:
    assert fastgate._driver(msg) is driver


# --- 1/4: `gpuwarden config check` refuses what a user can forge -------------------------------

def _config_check(tmp_path: Path, kernel_log: Path) -> tuple[int, str]:
    bin_dir = tmp_path / "slurm-bin"
    bin_dir.mkdir(mode=0o755, exist_ok=True)
    (bin_dir / "scontrol").write_text("#!/bin/sh\n")
    (bin_dir / "scontrol").chmod(0o755)
    cfg = tmp_path / "gpuwarden.toml"
    cfg.write_text(f"[slurm]\nbin_dir = '{bin_dir}'\n[health]\nkernel_log = '{kernel_log}'\n")
    res = CliRunner().invoke(cli, ["config", "check", str(cfg)], obj=Context(config_path=None))
    return res.exit_code, res.output


def test_config_check_refuses_a_syslog_kernel_log_and_accepts_journal_json(
        tmp_path: Path) -> None:
    syslog = tmp_path / "kern.log"
    syslog.write_text(f"{_stamp()} gpu01 kernel: {FAKE}\n")
    syslog.chmod(0o644)
    code, out = _config_check(tmp_path, syslog)
    assert code == 2 and "any user can forge" in out and "journalctl -k -o json" in out
    journal = tmp_path / "kern.json"
    journal.write_text(json.dumps({"MESSAGE": FAKE, "_TRANSPORT": "kernel"}) + "\n")
    journal.chmod(0o644)
    code, out = _config_check(tmp_path, journal)
    assert code == 0 and "OK" in out, out
