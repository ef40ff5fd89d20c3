from gpuwarden.health import xid
from gpuwarden.health.model import Status

BOOT = 1_700_000_000.0
NOW = BOOT + 10_000
BUS = {"0000:68:00": 5, "0000:18:00": 0}


def rec(xid_no: int, secs: float, bus: str = "0000:68:00", seq: int = 1) -> str:
    return (f"3,{seq},{int(secs * 1e6)},-;NVRM: Xid (PCI:{bus}): {xid_no}, pid=42, "
            f"name=python, GPU has fallen off the bus.")


def evaluate(*lines: str, window: float = 3600, gpus: set[int] | None = None) -> list:
    return xid.evaluate(xid.parse_kmsg("\n".join(lines), BOOT), BUS, NOW, window, gpus)


def test_xid79_is_critical_and_names_the_gpu_and_time() -> None:
    (r,) = evaluate(rec(79, 9_990))
    assert r.status == Status.CRITICAL and r.gpu == 5
    assert r.evidence.startswith("xid 79 on GPU 5 at 2023-11-1")


def test_63_92_and_94_do_not_drain_by_themselves() -> None:
    for n in (63, 92, 94):
        results = evaluate(rec(n, 9_990))
        assert all(r.status != Status.CRITICAL for r in results), n


def test_repeats_past_the_threshold_do_drain() -> None:
    results = evaluate(*(rec(92, 7_000 + 2 * i, seq=i) for i in range(20)))
    (r,) = [r for r in results if r.status == Status.CRITICAL]
    assert "20x" in r.evidence


def test_94_drains_for_reset_by_its_own_rst_flags_not_by_counting() -> None:
    def line94(flags: str, secs: float, seq: int) -> str:
        return (f"3,{seq},{int(secs * 1e6)},-;NVRM: Xid (PCI:0000:68:00): 94, pid=7062, "
                f"Contained: CE User Channel (0x9). {flags}")
    many = evaluate(*(line94("RST: No, D-RST: No", 7_000 + 2 * i, i) for i in range(10)))
    assert all(r.status != Status.CRITICAL for r in many)
    for flags in ("RST: Yes, D-RST: No", "RST: No, D-RST: Yes"):
        (r,) = evaluate(line94(flags, 9_990, 1))
        assert r.status == Status.CRITICAL and r.evidence.endswith("needs GPU reset"), flags


def test_application_xids_are_ignored_and_unknown_ones_warn() -> None:
    assert [r.status for r in evaluate(rec(13, 9_990))] == [Status.OK]
    (r,) = evaluate(rec(999, 9_990))
    assert r.status == Status.WARNING and "not in gpuwarden's policy" in r.message


def test_repeats_outside_the_window_are_forgotten() -> None:
    old = [rec(94, 1_000 + i, seq=i) for i in range(3)]
    assert [r.status for r in evaluate(*old, window=3600)] == [Status.OK]


def test_fatal_xids_count_since_boot_whatever_the_window() -> None:
    (r,) = evaluate(rec(79, 1_000), window=3600)
    assert r.status == Status.CRITICAL


def test_unknown_bus_is_reported_by_address() -> None:
    (r,) = evaluate(rec(79, 9_990, bus="0000:ff:00"))
    assert "PCI 0000:ff:00" in r.evidence and r.gpu is None


def test_job_gpu_filter_skips_other_gpus() -> None:
    assert [r.status for r in evaluate(rec(79, 9_990), gpus={0, 1})] == [Status.OK]


def test_garbage_is_unknown_not_a_drain() -> None:
    results = evaluate("total garbage", "3,1,5,-;NVRM: Xid (PCI:zz): abc", rec(48, 9_990))
    statuses = {r.status for r in results}
    assert Status.UNKNOWN in statuses
    unknown = next(r for r in results if r.status == Status.UNKNOWN)
    assert "1 malformed line(s)" in unknown.message and "line 1" in unknown.message
    # a well-formed fatal XID next to the garbage still counts
    assert Status.CRITICAL in statuses


def test_a_kernel_record_with_the_prefix_but_not_the_drivers_shape_is_counted_not_unknown() -> None:
    # Any user can make such a record (a process name, an OOM report): never the verdict.
    log = xid.parse_kmsg("3,1,5,-;NVRM: Xid (PCI:zz): abc", BOOT)
    assert not log.malformed and log.unshaped == 1
    (r,) = xid.evaluate(log, BUS, NOW, 3600)
    assert r.status == Status.OK and "1 kernel record(s) with the driver's prefix" in r.message


def test_other_kernel_messages_and_continuations_are_skipped() -> None:
    text = "6,1,5,-;usb 1-1: new device\n SUBSYSTEM=usb\n" + rec(79, 9_990)
    log = xid.parse_kmsg(text, BOOT)
    assert len(log.events) == 1 and not log.malformed
