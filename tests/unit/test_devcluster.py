"""The test cluster's pure parts: shape from the environment, addresses, image tag."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from gpuwarden.devcluster import image, spec
from gpuwarden.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_default_shape_is_eight_nodes_in_two_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("GPUWARDEN_NODES", "GPUWARDEN_NODES_PER_LEAF", "GPUWARDEN_GPUS"):
        monkeypatch.delenv(var, raising=False)
    s = spec.from_env()
    assert s.node_names == [f"c{i}" for i in range(1, 9)]
    assert s.cluster.nodes_per_leaf == 4 and s.cluster.gpus_per_node == 8


def test_one_setting_changes_the_node_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWARDEN_NODES", "16")
    assert len(spec.from_env().node_names) == 16


@pytest.mark.parametrize(("var", "value"), [("GPUWARDEN_NODES", "many"),
                                             ("GPUWARDEN_NODES", "0"),
                                             ("GPUWARDEN_NODES", "999")])
def test_bad_shape_settings_are_refused(monkeypatch: pytest.MonkeyPatch, var: str, value: str) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match="GPUWARDEN_NODES|nodes"):
        spec.from_env()


def test_addresses_are_fixed_and_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWARDEN_NODES", "200")
    addrs = spec.from_env().addresses()
    assert len(set(addrs.values())) == len(addrs) == 203
    assert addrs["slurmctld"] == "172.29.0.11" and addrs["c1"] == "172.29.1.1"


def test_image_tag_is_stable_and_follows_its_inputs(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "docker-cluster" / "image", root / "docker-cluster" / "image")
    first = image.image_tag(root)
    assert first == image.image_tag(root) and first.startswith("gpuwarden-cluster:")
    pkgs = root / "docker-cluster" / "image" / "packages.txt"
    pkgs.write_text(pkgs.read_text() + "# a comment changes nothing\n")
    assert image.image_tag(root) == first
    pkgs.write_text(pkgs.read_text() + "strace\n")
    assert image.image_tag(root) != first


def test_image_build_without_root_or_debootstrap_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(image.os, "geteuid", lambda: 1000)
    with pytest.raises(image.ImageBuildError, match="sudo make cluster-up"):
        image._check_prerequisites()
    monkeypatch.setattr(image.os, "geteuid", lambda: 0)
    monkeypatch.setattr(image.shutil, "which", lambda _name: None)
    with pytest.raises(image.ImageBuildError, match="apt-get install -y debootstrap"):
        image._check_prerequisites()


class _Runs:
    """Stands in for a Cluster whose hosts answer `scontrol --version` with ``answer``."""

    def __init__(self, slurm: str, answer: str) -> None:
        self.spec = dataclasses.replace(spec.from_env(), slurm=slurm)
        self.answer = answer

    def exec(self, host: str, argv: list[str], timeout: float = 60.0) -> object:
        from gpuwarden.devcluster.exec import ExecResult
        return ExecResult(0, self.answer, "")


@pytest.mark.parametrize("slurm", ["24.11", "26.05"])
def test_the_cluster_says_which_slurm_it_runs(slurm: str) -> None:
    from gpuwarden.devcluster.cluster import Cluster
    got = Cluster.check_release(_Runs(slurm, f"slurm {slurm}.5\n"), "tag")  # type: ignore[arg-type]
    assert got == f"slurm {slurm}.5"


def test_an_image_running_another_slurm_than_asked_is_refused() -> None:
    # Debian's testing suite moving on to 26.11 must not pass as 26.05 tested end to end.
    from gpuwarden.devcluster.cluster import Cluster, ClusterError
    with pytest.raises(ClusterError, match=r"GPUWARDEN_SLURM=26.05, but slurmctld .*26.11.1"):
        Cluster.check_release(_Runs("26.05", "slurm 26.11.1\n"), "tag")  # type: ignore[arg-type]


def test_an_exec_whose_stream_never_ends_is_given_up_at_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A loaded CI run hung 900 s in exec_run after the command's own `timeout` had passed.
    import threading
    import time

    from gpuwarden.devcluster import exec as dexec

    class Stuck:
        def exec_run(self, *args: object, **kwargs: object) -> object:
            threading.Event().wait()  # dockerd never closes the stream
            raise AssertionError("unreachable")

    monkeypatch.setattr(dexec, "GRACE_S", 0.2)
    began = time.monotonic()
    with pytest.raises(dexec.ExecStalled, match="did not come back within"):
        dexec.run_in(Stuck(), ["apt-get", "update"], timeout=0.1)
    assert time.monotonic() - began < 5
