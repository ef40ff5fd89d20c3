"""devcluster/s3shape.py: the test cluster's S3 link shaped by a relay in the s3 container and an
nftables redirect to it, never `tc netem` (the hosts' kernels have none); the commands it runs
through a fake `run`, and once for real on this host (the relay started detached, waited for,
stopped) with only nft faked."""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster import s3relay, s3shape
from devcluster.s3shape import Shape, ShapeError

HOW = Shape("15ms", "1gbit")
ARGS = ["--listen", "8334", "--to", "127.0.0.1:8333", "--delay-ms", "15", "--rate", "1gbit",
        "--pidfile", "/run/gpuwarden-s3relay.pid"]


class FakeS3:
    """The s3 container as the shaping sees it: a kernel without netem, nft, the relay (which
    listens ``listens_after`` status polls after its start, or never)."""

    def __init__(self, listens_after: int | None = 1, nft: tuple[int, str] = (0, "")) -> None:
        self.calls: list[list[str]] = []
        self.relay: list[str] | None = None
        self.starting: list[str] | None = None
        self.listens_after = listens_after
        self.polls = 0
        self.redirect = False
        self.nft = nft

    def __call__(self, host: str, argv: list[str]) -> tuple[int, str]:
        assert host == "s3", f"{argv} run on {host}: only the s3 container is touched"
        self.calls.append(argv)
        if argv[0] == "tc":
            return 2, 'Error: Specified qdisc kind is unknown.\nUnknown qdisc "netem"'
        if argv == s3shape.status_command():
            if self.starting is not None:
                self.polls += 1
                if self.listens_after is not None and self.polls > self.listens_after:
                    self.relay, self.starting = self.starting, None
            return (0, json.dumps(self.relay) + "\n") if self.relay else (3, "s3relay: not running\n")
        if argv == s3shape.stop_command():
            self.relay = self.starting = None
            return 0, ""
        if argv[:2] == ["bash", "-c"]:
            words = shlex.split(argv[2])
            self.starting = words[3:words.index("</dev/null")]
            self.polls = 0
            return 0, ""
        if argv[0] == "nft":
            if self.nft[0] == 0:
                self.redirect = "redirect" in argv[1]
            return self.nft
        if argv[0] == "tail":
            return 0, "OSError: [Errno 98] address already in use\n"
        raise AssertionError(f"unexpected command {argv}")

    def kinds(self) -> list[str]:
        names = {"bash": "start", "nft": "nft", "tail": "tail"}
        return [names[a[0]] if a[0] in names else a[2] for a in self.calls]


def _no_sleep(_: float) -> None:
    pass


def test_shaping_starts_a_relay_then_redirects_to_it_and_never_uses_netem() -> None:
    s3 = FakeS3()
    s3shape.shape(s3, HOW, sleep=_no_sleep)
    assert not any(a[0] == "tc" for a in s3.calls)
    assert s3.relay == ARGS and s3.redirect
    # Stopped first (a dead relay's pid file), the redirect only once the relay listens.
    assert s3.kinds() == ["--status", "--stop", "start", "--status", "--status", "nft"]


def test_the_relay_is_started_detached_with_its_output_in_a_log() -> None:
    assert s3shape.start_command(HOW) == [
        "bash", "-c",
        "setsid python3 /src/gpuwarden/devcluster/s3relay.py " + " ".join(ARGS)
        + " </dev/null >>/var/log/gpuwarden-s3relay.log 2>&1 &"]
    assert s3shape.status_command() == [
        "python3", "/src/gpuwarden/devcluster/s3relay.py", "--status", "--pidfile",
        "/run/gpuwarden-s3relay.pid"]
    assert s3shape.stop_command()[2:] == ["--stop", "--pidfile", "/run/gpuwarden-s3relay.pid"]
    assert s3shape.relay_args(Shape("2.5ms", "500mbit"))[4:8] == [
        "--delay-ms", "2.5", "--rate", "500mbit"]


def test_the_redirect_takes_new_connections_from_the_network_only_in_one_transaction() -> None:
    assert s3shape.redirect_command() == [
        "nft",
        "add table ip gpuwarden_s3relay; delete table ip gpuwarden_s3relay; "
        "add table ip gpuwarden_s3relay; add chain ip gpuwarden_s3relay prerouting "
        "{ type nat hook prerouting priority dstnat; policy accept; }; "
        'add rule ip gpuwarden_s3relay prerouting iifname != "lo" tcp dport 8333 '
        "redirect to :8334"]
    assert s3shape.unredirect_command() == [
        "nft", "add table ip gpuwarden_s3relay; delete table ip gpuwarden_s3relay"]


def test_shaping_again_keeps_a_relay_with_the_same_values_and_replaces_one_with_others() -> None:
    s3 = FakeS3()
    s3shape.shape(s3, HOW, sleep=_no_sleep)
    s3.calls.clear()
    s3shape.shape(s3, HOW, sleep=_no_sleep)
    assert s3.kinds() == ["--status", "nft"]  # its connections live on
    s3.calls.clear()
    s3shape.shape(s3, Shape("40ms", "100mbit"), sleep=_no_sleep)
    assert s3.kinds() == ["--status", "--stop", "start", "--status", "--status", "nft"]
    assert s3.relay is not None and s3.relay[4:8] == ["--delay-ms", "40", "--rate", "100mbit"]


def test_a_relay_that_does_not_listen_fails_naming_the_container_command_and_log() -> None:
    s3 = FakeS3(listens_after=None)
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s
    with pytest.raises(ShapeError, match=r"(?s)container s3: the S3 relay did not listen on port "
                       r"8334 within 15 s of `bash -c 'setsid python3 .*s3relay.py.*"
                       r"gpuwarden-s3relay.log:\nOSError: \[Errno 98\]"):
        s3shape.shape(s3, HOW, clock=lambda: now[0], sleep=sleep)
    assert not s3.redirect  # connections still go straight to S3
    assert 15 <= now[0] < 16


def test_unshaping_removes_the_redirect_then_the_relay_and_twice_is_fine() -> None:
    s3 = FakeS3()
    s3shape.shape(s3, HOW, sleep=_no_sleep)
    s3.calls.clear()
    s3shape.unshape(s3)
    assert s3.kinds() == ["nft", "--stop"]
    assert s3.calls[0] == s3shape.unredirect_command()
    assert s3.relay is None and not s3.redirect
    s3shape.unshape(s3)


def test_a_failing_nft_says_which_container_and_command() -> None:
    s3 = FakeS3(nft=(1, "Error: Could not process rule: Operation not permitted\n"))
    with pytest.raises(ShapeError, match=r"container s3: `nft 'add table ip gpuwarden_s3relay;.*"
                       r"redirect to :8334'` failed \(exit 1\): Error: Could not process rule: "
                       r"Operation not permitted"):
        s3shape.shape(s3, HOW, sleep=_no_sleep)


@pytest.mark.parametrize("bad", ["15", "fast,1gbit", "15ms,lots", "15ms", "15ms,0gbit",
                                 "15 ms,1gbit"])
def test_a_shape_that_is_not_delay_and_rate_is_refused(bad: str) -> None:
    with pytest.raises(ShapeError):
        Shape.parse(bad)


def test_the_commands_start_wait_for_and_stop_a_real_relay(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The same start, --status and --stop commands, run here by a local `run` (nft faked)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pidfile = tmp_path / "relay.pid"
    monkeypatch.setattr(s3shape, "PYTHON", sys.executable)
    monkeypatch.setattr(s3shape, "RELAY", str(Path(s3relay.__file__)))
    monkeypatch.setattr(s3shape, "PIDFILE", str(pidfile))
    monkeypatch.setattr(s3shape, "LOG", str(tmp_path / "relay.log"))
    monkeypatch.setattr(s3shape, "RELAY_PORT", port)
    nft: list[str] = []

    def run(host: str, argv: list[str]) -> tuple[int, str]:
        if argv[0] == "nft":
            nft.append(argv[1])
            return 0, ""
        got = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        return got.returncode, got.stdout + got.stderr
    try:
        s3shape.shape(run, HOW)
        pid = int(pidfile.read_text())
        with socket.create_connection(("127.0.0.1", port), 10):
            pass  # it listens
        s3shape.shape(run, HOW)
        assert int(pidfile.read_text()) == pid  # the same relay
        s3shape.unshape(run)
        assert not pidfile.exists()
        assert s3relay._cmdline(pid) is None  # gone
        assert "listening on 0.0.0.0" in (tmp_path / "relay.log").read_text()
        assert [("redirect" in n) for n in nft] == [True, True, False]
    finally:
        s3relay.stop(pidfile)


def test_a_relay_that_cannot_run_at_all_says_so() -> None:
    def run(host: str, argv: list[str]) -> tuple[int, str]:
        return 2, "python3: can't open file '/src/gpuwarden/devcluster/s3relay.py': [Errno 2]\n"
    with pytest.raises(ShapeError, match=r"container s3: `python3 /src/gpuwarden/devcluster/"
                       r"s3relay.py --status --pidfile /run/gpuwarden-s3relay.pid`: exit 2: "
                       r"python3: can't open file"):
        s3shape.shape(run, HOW)
