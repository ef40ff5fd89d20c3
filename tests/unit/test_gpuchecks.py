from dataclasses import replace

import pytest

from gpuwarden.config.health import Expected
from gpuwarden.health import gpuchecks
from gpuwarden.health.model import GpuObs, GpuSnapshot, Status
from gpuwarden.health.probe import ProbeError, healthy_fake, parse_fake

HEALTHY = parse_fake(healthy_fake(8), "fake")
EXP = Expected(gpu_count=8, nvlink_links=18)


def with_gpu(index: int, **changes: object) -> GpuSnapshot:
    gpus = tuple(replace(g, **changes) if g.index == index else g for g in HEALTHY.gpus)
    return GpuSnapshot(gpus)


def crit(snap: GpuSnapshot, exp: Expected = EXP, gpus: set[int] | None = None) -> list[str]:
    return [r.evidence for r in gpuchecks.evaluate(snap, exp, gpus) if r.status == Status.CRITICAL]


def test_healthy_node_passes() -> None:
    assert [r.status for r in gpuchecks.evaluate(HEALTHY, EXP)] == [Status.OK]


@pytest.mark.parametrize(
    ("changes", "evidence"),
    [
        ({"ecc_uncorrected_volatile": 2}, "2 uncorrectable ECC errors on GPU 3"),
        ({"remapped_rows_pending": True}, "row remap pending, needs GPU reset on GPU 3"),
        ({"remapped_rows_failed": True}, "row remapping failed on GPU 3"),
        ({"retired_pages_pending": True}, "page retirement pending, needs GPU reset on GPU 3"),
        ({"nvlink_up": (True,) * 16 + (False,) * 2}, "NVLink 2 of 18 links down on GPU 3"),
        ({"pcie_width": 8}, "PCIe x8, expected x16 on GPU 3"),
        ({"inforom_valid": False}, "InfoROM corrupt on GPU 3"),
        ({"fabric_state": "in_progress"}, "NVLink fabric state in_progress on GPU 3"),
        ({"recovery_action": 2}, "driver asks for recovery: node reboot on GPU 3"),
    ],
)
def test_each_fatal_signal_names_its_evidence(changes: dict, evidence: str) -> None:
    assert crit(with_gpu(3, **changes)) == [evidence]


@pytest.mark.parametrize(
    "changes",
    [{"clock_event_reasons": gpuchecks.HW_SLOWDOWN | gpuchecks.POWER_BRAKE},
     {"temperature_c": 95}, {"persistence_mode": False}, {"nvlink_errors": 12},
     {"pcie_gen": 3}],
)
def test_soft_signals_warn_without_draining(changes: dict) -> None:
    results = gpuchecks.evaluate(with_gpu(1, **changes), replace(EXP, pcie_gen=5))
    assert {r.status for r in results} == {Status.WARNING}


def test_missing_gpu_is_critical() -> None:
    snap = GpuSnapshot(HEALTHY.gpus[:7])
    assert crit(snap) == ["7 of 8 GPUs visible"]


def test_job_gpu_subset_limits_per_gpu_checks() -> None:
    snap = with_gpu(5, ecc_uncorrected_volatile=1)
    assert crit(snap, gpus={0, 1}) == []
    assert crit(snap, gpus={5}) == ["1 uncorrectable ECC errors on GPU 5"]


def test_nvlink_not_checked_when_not_expected() -> None:
    snap = with_gpu(0, nvlink_up=())
    assert crit(snap, replace(EXP, nvlink_links=0)) == []


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "not JSON"),
        ('{"gpus": 3}', "'gpus' list"),
        ('{"gpus": [{"index": "zero"}]}', r"gpus\[0\].index"),
        ('{"gpus": [{"index": 0, "colour": "red"}]}', "unknown field 'colour'"),
        ('{"gpus": [{"index": 0}, {"index": 0}]}', "duplicate GPU index"),
        ('{"gpus": [{"index": 0, "nvlink_up": [1, 0]}]}', "list of true/false"),
        ('{"gpus": [{"pci_bus_id": "x"}]}', "missing 'index'"),
    ],
)
def test_bad_fake_files_are_clear_errors(text: str, match: str) -> None:
    with pytest.raises(ProbeError, match=match):
        parse_fake(text, "/x/gpus.json")


def test_bus_ids_match_across_nvml_and_kernel_spellings() -> None:
    snap = GpuSnapshot((GpuObs(index=2, pci_bus_id="00000000:3B:00.0"),))
    assert snap.by_bus_id() == {"0000:3b:00": 2}


def test_the_fake_stands_in_for_a_driver_that_cannot_be_opened() -> None:
    # The test cluster injects this fault by writing init_error into a node's fake file.
    snap = parse_fake('{"gpus": [], "init_error": "NVMLError_DriverNotLoaded: Driver Not Loaded"}',
                      "fake")
    (r,) = gpuchecks.evaluate(snap, EXP)
    assert r.status == Status.CRITICAL and "NVMLError_DriverNotLoaded" in r.evidence
    with pytest.raises(ProbeError, match="init_error"):
        parse_fake('{"gpus": [], "init_error": 9}', "fake")
