"""`gpuwarden health inject`: a rehearsed Xid on a test node drains it through the same code
path as a real one, and nothing is written where it must not be."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from gpuwarden import config as configmod
from gpuwarden.cli import cli
from gpuwarden.config.context import Context
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


def test_xid_output_warns_that_accounting_keeps_the_drain(node: Path) -> None:
    code, out, err = gw("health", "inject", "xid", "79", "--gpu", "5")
    assert code == 0, err
    assert "lemon scan" in out and "injected on c3 at " in out and "UTC" in out


# ---- clear replaces only a test file (review LOW 7) -------------------------------------------
def point_gpu_file_at(path: Path) -> None:
    conf = Path(os.environ["GPUWARDEN_CONFIG"])
    conf.write_text("\n".join(f'fake_gpu_file = "{path}"' if line.startswith("fake_gpu_file")
                              else line for line in conf.read_text().splitlines()))


@pytest.mark.parametrize("content", [
    b"[server]\nport = 8080\n",                   # a site's config, not JSON
    b'{"listen": "0.0.0.0", "port": 8080}\n',      # JSON, but no GPU list
    b'{"gpus": [{"index": 0, "colour": "red"}]}',  # a GPU field no fake file has
    b'{"gpus": [], "note": "caf\xe9"}',            # not UTF-8
])
def test_clear_never_replaces_a_file_that_is_not_a_fake_gpu_file(node: Path,
                                                                    content: bytes) -> None:
    precious = node / "precious.conf"
    precious.write_bytes(content)
    before = precious.read_bytes()
    (node / "kmsg").write_text("3,1,5,-;NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=x, gone\n")
    point_gpu_file_at(precious)
    code, _out, err = gw("health", "inject", "clear")
    assert code == 2
    assert "not a fake GPU file" in err and f"rm {precious}" in err
    assert precious.read_bytes() == before
    # Both files are checked before either is written.
    assert (node / "kmsg").read_text().startswith("3,1,5,-;NVRM: Xid")


@pytest.mark.parametrize("args", [("clear",), ("xid", "79", "--gpu", "5")])
def test_a_rehearsed_hang_does_not_stall_inject(node: Path, args: tuple[str, ...]) -> None:
    """The fake file's `hang` stands in for a wedged driver in the probe; inject only reads the
    file's GPUs, and clear is how a hang is undone."""
    doc = json.loads((node / "gpus.json").read_text())
    (node / "gpus.json").write_text(json.dumps({**doc, "hang": 5}))
    started = time.monotonic()
    code, _out, err = gw("health", "inject", *args)
    assert code == 0, err
    assert time.monotonic() - started < 3


# ---- --text is one line (review LOW 8) --------------------------------------------------------
@pytest.mark.parametrize("sep", ["\n", "\r", "\x85", "\u2028", "\x00", "\x1b"])
def test_text_with_a_line_break_or_control_character_is_refused(node: Path, sep: str) -> None:
    forged = "3,99,1,-;NVRM: Xid (PCI:0000:18:00): 48, pid='<unknown>', name=<unknown>, DBE"
    code, out, err = gw("health", "inject", "xid", "13", "--gpu", "0", "--text", f"x{sep}{forged}")
    assert code == 2 and "one line" in err and out == ""
    assert (node / "kmsg").read_text() == ""
    assert [s for s, _, _ in verdict_xid(node)] == [Status.OK]


def test_xid_line_refuses_a_bus_id_that_is_not_nvmls() -> None:
    with pytest.raises(inject.InjectError, match="00000000:3B:00.0"):
        inject.xid_line(79, "0:18:00.0\n3,9,1,-;x", "gone", 1, 1)


# ---- the whole path is checked, and written through what was checked (review LOW 9) -----------
def move_faults_to(node: Path, parent: Path) -> Path:
    """The fault files moved under ``parent``, and the config pointed there."""
    faults = parent / "fake"
    node.rename(faults)
    conf = Path(os.environ["GPUWARDEN_CONFIG"])
    conf.write_text(conf.read_text().replace(f"{node}/", f"{faults}/"))
    return faults


def test_a_parent_directory_others_can_write_is_refused(node: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # anyone could rename fake/ away and put their own in its place
    faults = move_faults_to(node, shared)
    code, _out, err = gw("health", "inject", "xid", "79", "--gpu", "5")
    assert code == 2 and f"{shared} is writable by group or others" in err
    assert (faults / "kmsg").read_text() == ""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_parent_directory_of_another_user_is_refused(node: Path, tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    faults = move_faults_to(node, theirs)
    code, _out, err = gw("health", "inject", "clear")
    assert code == 2 and f"{theirs} is owned by uid 65534" in err
    assert (faults / "kmsg").read_text() == ""


def test_a_link_above_the_test_directory_is_refused(node: Path, tmp_path: Path) -> None:
    """A user's link (root's own, in root's directory, is followed as /var/run -> /run is)."""
    real = tmp_path / "real"
    real.mkdir()
    move_faults_to(node, real)
    (tmp_path / "via").symlink_to(real)
    if os.geteuid() == 0:
        os.lchown(tmp_path / "via", 65534, 65534)
    conf = Path(os.environ["GPUWARDEN_CONFIG"])
    conf.write_text(conf.read_text().replace(f"{real}/", f"{tmp_path}/via/"))
    code, _out, err = gw("health", "inject", "xid", "79", "--gpu", "5")
    assert code == 2 and "symbolic link" in err
    assert (real / "fake" / "kmsg").read_text() == ""


def test_the_record_goes_into_the_directory_that_was_checked(
        node: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Renaming the directory away between the check and the write, and putting another in
    its place, does not redirect the write."""
    moved = tmp_path / "moved"
    real_xid_line = inject.xid_line

    def swap_then_format(*args: Any) -> str:
        node.rename(moved)
        node.mkdir(mode=0o755)
        (node / "kmsg").write_text("")
        return real_xid_line(*args)

    monkeypatch.setattr(inject, "xid_line", swap_then_format)
    code, _out, err = gw("health", "inject", "xid", "79", "--gpu", "5")
    assert code == 0, err
    assert (node / "kmsg").read_text() == ""
    assert ": 79, " in (moved / "kmsg").read_text()


def test_a_path_with_dot_dot_is_refused(node: Path) -> None:
    conf = Path(os.environ["GPUWARDEN_CONFIG"])
    conf.write_text(conf.read_text().replace(f"{node}/kmsg", f"{node}/../fake/kmsg"))
    code, _out, err = gw("health", "inject", "clear")
    assert code == 2 and "without . or .." in err


def test_a_deeply_nested_file_is_refused_not_a_traceback(node: Path) -> None:
    (node / "gpus.json").write_text("[" * 100_000 + "]" * 100_000)
    code, _out, err = gw("health", "inject", "clear")
    assert code == 2 and "not a fake GPU file" in err
