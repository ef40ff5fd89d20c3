"""`gpuwarden health inject`: a rehearsed Xid on a test node drains it through the same code
path as a real one, and nothing is written where it must not be."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden import config as configmod
from gpuwarden.cli import Context, cli
from gpuwarden.health import fastgate, gather, inject
from gpuwarden.health.model import Status
from gpuwarden.health.probe import healthy_fake


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A test node's config and fault files, as the test cluster's nodes have them."""
    faults = tmp_path / "fake"
    faults.mkdir(mode=0o755)
    (faults / "gpus.json").write_text(healthy_fake(8))
    (faults / "kmsg").write_text("")
    conf = tmp_path / "gpuwarden.toml"
    conf.write_text(f"""
[health]
gpu_probe = "fake"
fake_gpu_file = "{faults}/gpus.json"
kernel_log = "{faults}/kmsg"
state_dir = "{tmp_path}/state"
""")
    monkeypatch.setenv("GPUWARDEN_CONFIG", str(conf))
    monkeypatch.setenv("SLURMD_NODENAME", "c3")
    monkeypatch.setattr(inject, "is_root", lambda: True)
    return faults


def gw(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(cli, list(args), obj=Context())
    return res.exit_code, res.stdout, res.stderr


def verdict_xid(faults: Path) -> list[tuple[Status, int | None, str]]:
    cfg = configmod.load(os.environ["GPUWARDEN_CONFIG"]).health
    v = gather.gather(cfg, "c3", "test", 10.0)
    return [(r.status, r.gpu, r.evidence) for r in v.results if r.check == "xid"]


def test_an_injected_xid_79_drains_like_the_drivers(node: Path) -> None:
    code, out, err = gw("health", "inject", "xid", "79", "--gpu", "5")
    assert code == 0, err
    assert "drains the node" in out and "gpuwarden health inject clear" in out
    (status, gpu, evidence), = verdict_xid(node)
    assert (status, gpu) == (Status.CRITICAL, 5)
    assert evidence.startswith("xid 79 on GPU 5 at ")
    # The prolog's fast path sees it too, so the next job on the node goes the full way.
    assert "NVIDIA driver kernel record" in fastgate.driver_records_since(
        str(node / "kmsg"), 0.0, 0.0)


def test_the_record_is_the_drivers_kmsg_format(node: Path) -> None:
    gw("health", "inject", "xid", "48", "--gpu", "0")
    gw("health", "inject", "xid", "79", "--gpu", "1")
    lines = (node / "kmsg").read_text().splitlines()
    assert [line.split(",", 3)[:2] for line in lines] == [["3", "1"], ["3", "2"]]
    assert lines[1].split(";", 1)[1] == ("NVRM: Xid (PCI:0000:28:00): 79, pid='<unknown>', "
                                         "name=<unknown>, GPU has fallen off the bus.")


def test_clear_undoes_it_and_writes_a_healthy_gpu_file(node: Path) -> None:
    gw("health", "inject", "xid", "79", "--gpu", "5")
    (node / "gpus.json").unlink()
    code, out, _ = gw("health", "inject", "clear")
    assert code == 0
    assert "8 healthy GPUs" in out and "resumed after 3 passing" in out
    assert (node / "kmsg").read_text() == ""
    assert [s for s, _, _ in verdict_xid(node)] == [Status.OK]


def test_an_xid_that_does_not_drain_says_so(node: Path) -> None:
    _code, out, _ = gw("health", "inject", "xid", "13", "--gpu", "2")
    assert "no drain" in out and "use 79" in out


@pytest.mark.parametrize(("setting", "why"), [
    ('kernel_log = "/dev/kmsg"', "reads the real kernel log"),
    ('gpu_probe = "nvml"', 'gpu_probe = "nvml"'),
])
def test_a_real_node_is_refused_with_what_to_configure(node: Path, setting: str, why: str) -> None:
    conf = Path(os.environ["GPUWARDEN_CONFIG"])
    key = setting.split(" ")[0]
    conf.write_text("\n".join(setting if line.startswith(key) else line
                              for line in conf.read_text().splitlines()))
    code, _out, err = gw("health", "inject", "xid", "79", "--gpu", "5")
    assert code == 2
    assert why in err and "docs/testing-without-gpus.md" in err
    assert (node / "kmsg").read_text() == ""


def test_not_root_is_refused(node: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inject, "is_root", lambda: False)
    code, _out, err = gw("health", "inject", "clear")
    assert code == 2 and "run it as root" in err


def test_a_link_at_the_kernel_log_is_never_followed(node: Path, tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (node / "kmsg").unlink()
    (node / "kmsg").symlink_to(victim)
    for args in (("xid", "79", "--gpu", "5"), ("clear",)):
        code, _out, err = gw("health", "inject", *args)
        assert code == 2 and "a link?" in err
    assert victim.read_text() == "precious\n"


def test_a_directory_others_can_write_is_refused(node: Path) -> None:
    node.chmod(0o777)
    code, _out, err = gw("health", "inject", "xid", "79", "--gpu", "5")
    assert code == 2 and "writable by group or others" in err


def test_a_real_log_rendering_is_never_written_into(node: Path) -> None:
    journal = '{"MESSAGE": "usb 1-1: new device", "_TRANSPORT": "kernel"}\n'
    (node / "kmsg").write_text(journal)
    code, _out, err = gw("health", "inject", "xid", "79", "--gpu", "5")
    assert code == 2 and "not a test file" in err
    assert (node / "kmsg").read_text() == journal


def test_a_gpu_not_in_the_fake_file_is_refused(node: Path) -> None:
    code, _out, err = gw("health", "inject", "xid", "79", "--gpu", "9")
    assert code == 2 and "GPUs there: 0, 1, 2, 3, 4, 5, 6, 7" in err


def test_xid_line_shortens_nvmls_bus_id_as_the_driver_prints_it() -> None:
    line = inject.xid_line(79, "00000000:3B:00.0", "GPU has fallen off the bus.", 7, 1_500_000)
    assert line == ("3,7,1500000,-;NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', "
                    "name=<unknown>, GPU has fallen off the bus.\n")
