"""The test cluster's pure parts: shape from the environment, addresses, image tag."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster import image, spec
from gpuwarden.core.errors import ConfigError

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
    # The default cluster's (an xdist worker's session names its own in the environment).
    monkeypatch.delenv("GPUWARDEN_CLUSTER_NAME", raising=False)
    monkeypatch.delenv("GPUWARDEN_SUBNET", raising=False)
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
        from devcluster.exec import ExecResult
        return ExecResult(0, self.answer, "")


@pytest.mark.parametrize("slurm", ["24.11", "26.05"])
def test_the_cluster_says_which_slurm_it_runs(slurm: str) -> None:
    from devcluster.cluster import Cluster
    got = Cluster.check_release(_Runs(slurm, f"slurm {slurm}.5\n"), "tag")  # type: ignore[arg-type]
    assert got == f"slurm {slurm}.5"


def test_an_image_running_another_slurm_than_asked_is_refused() -> None:
    # Debian's testing suite moving on to 26.11 must not pass as 26.05 tested end to end.
    from devcluster.cluster import Cluster, ClusterError
    with pytest.raises(ClusterError, match=r"GPUWARDEN_SLURM=26.05, but slurmctld .*26.11.1"):
        Cluster.check_release(_Runs("26.05", "slurm 26.11.1\n"), "tag")  # type: ignore[arg-type]


def test_an_exec_whose_stream_never_ends_is_given_up_at_its_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A loaded CI run hung 900 s in exec_run after the command's own `timeout` had passed.
    import threading
    import time

    from devcluster import exec as dexec

    class Stuck:
        """dockerd never answers."""

        def __init__(self) -> None:
            self.client = self
            self.api = self

        def __getattr__(self, name: str) -> object:
            def call(*args: object, **kwargs: object) -> object:
                threading.Event().wait()
                raise AssertionError("unreachable")
            return call

    monkeypatch.setattr(dexec, "GRACE_S", 0.2)
    began = time.monotonic()
    with pytest.raises(dexec.ExecStalled, match="did not come back within"):
        dexec.run_in(Stuck(), ["apt-get", "update"], timeout=0.1)
    assert time.monotonic() - began < 5


# ---- clusters side by side (GPUWARDEN_CLUSTER_NAME) -------------------------------------------
def _named(monkeypatch: pytest.MonkeyPatch, name: str | None) -> spec.Spec:
    monkeypatch.delenv("GPUWARDEN_SUBNET", raising=False)
    if name is None:
        monkeypatch.delenv("GPUWARDEN_CLUSTER_NAME", raising=False)
    else:
        monkeypatch.setenv("GPUWARDEN_CLUSTER_NAME", name)
    return spec.from_env()


def test_the_default_cluster_keeps_every_name_it_had(monkeypatch: pytest.MonkeyPatch) -> None:
    # Containers made by older checkouts (label gpuwarden.testcluster=1, gpuwarden-*) are found.
    for name in (None, "", "gpuwarden"):
        s = _named(monkeypatch, name)
        assert (s.name, s.container_name("c1"), s.network, s.fsx_volume, s.state_dir_name) == (
            "gpuwarden", "gpuwarden-c1", "gpuwarden-net", "gpuwarden-fsx", ".state")
        assert s.subnet == "172.29.0.0/16" and s.label_filter == "gpuwarden.testcluster=1"
        assert s.labels["gpuwarden.testcluster"] == "1"
        assert (s.site_name, s.site_subnet) == ("gwsite", "172.30.0.0/24")


def test_a_named_cluster_has_its_own_docker_objects_and_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = _named(monkeypatch, "gwt1")
    assert (s.container_name("slurmctld"), s.network, s.fsx_volume, s.state_dir_name) == (
        "gwt1-slurmctld", "gwt1-net", "gwt1-fsx", ".state-gwt1")
    # Never the default's label key: an older checkout's down() removes all that carry it.
    assert s.labels == {"gpuwarden.cluster": "gwt1"}
    assert s.label_filter == "gpuwarden.cluster=gwt1"
    assert s.site_name == "gwt1site"


def test_named_clusters_get_subnets_apart_from_each_other_and_the_default(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import ipaddress

    # Every cluster `make test` can make (gwt<n> for the workers, gwv<n>.. for the other
    # releases) and names of one's own, which land apart from them.
    names = [f"gw{base}{i}" for base in "tuvwxy" for i in range(16)] + ["mine", "gwt16"]
    specs = [_named(monkeypatch, n) for n in names]
    nets = [ipaddress.ip_network(s.subnet) for s in specs] + [ipaddress.ip_network("172.29.0.0/16")]
    sites = [ipaddress.ip_network(s.site_subnet) for s in specs] + [
        ipaddress.ip_network("172.30.0.0/24")]
    every = nets + sites
    for i, a in enumerate(every):
        assert not any(a.overlaps(b) for b in every[i + 1:]), a
    # A subnet holds the cluster's largest shape (250 nodes) and never moves between runs.
    monkeypatch.setenv("GPUWARDEN_NODES", "250")
    big = _named(monkeypatch, "gwt3")
    net = ipaddress.ip_network(big.subnet)
    assert all(ipaddress.ip_address(a) in net for a in big.addresses().values())
    assert big.subnet == _named(monkeypatch, "gwt3").subnet


def test_gpuwarden_subnet_still_overrides_a_named_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWARDEN_CLUSTER_NAME", "mine")
    monkeypatch.setenv("GPUWARDEN_SUBNET", "10.9.0.0/16")
    assert spec.from_env().subnet == "10.9.0.0/16"


@pytest.mark.parametrize("bad", ["GWT1", "1gwt", "gw-t", "gwt 1", "a" * 17, "gwt1/../x"])
def test_a_cluster_name_docker_or_a_host_name_cannot_take_is_refused(
        monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("GPUWARDEN_CLUSTER_NAME", bad)
    with pytest.raises(ConfigError, match="GPUWARDEN_CLUSTER_NAME"):
        spec.from_env()


def test_an_xdist_worker_names_its_cluster_after_itself() -> None:
    assert spec.name_for_worker("gw0", None) == "gwt0"
    assert spec.name_for_worker("gw11", "gwv") == "gwv11"
    with pytest.raises(ConfigError, match="PYTEST_XDIST_WORKER"):
        spec.name_for_worker("master", None)


class _Obj:
    def __init__(self, name: str, labels: dict[str, str]) -> None:
        self.name, self.labels = name, labels
        self.attrs = {"Labels": labels}
        self.removed = False

    def remove(self, **_kw: object) -> None:
        self.removed = True


class _Listing:
    """Docker's list filters as the daemon applies them: label key or key=value, name substring."""

    def __init__(self, objs: list[_Obj]) -> None:
        self.objs = objs

    def list(self, all: bool = False, names: list[str] | None = None,
             filters: dict[str, str] | None = None) -> list[_Obj]:
        out = self.objs
        if names:
            out = [o for o in out if any(n in o.name for n in names)]
        if filters and "name" in filters:
            out = [o for o in out if filters["name"] in o.name]
        if filters and "label" in filters:
            key, _, value = filters["label"].partition("=")
            out = [o for o in out if key in o.labels and (not value or o.labels[key] == value)]
        return out


class _Docker:
    def __init__(self, clusters: dict[str, spec.Spec], old_default: bool) -> None:
        self.containers = _Listing([])
        self.networks = _Listing([])
        self.volumes = _Listing([])
        for s in clusters.values():
            labels = {"gpuwarden.testcluster": "1"} if old_default and s.is_default else s.labels
            self.containers.objs += [_Obj(s.container_name(h), labels) for h in ("c1", "s3")]
            self.networks.objs.append(_Obj(s.network, labels))
            self.volumes.objs.append(_Obj(s.fsx_volume, {}))


@pytest.mark.parametrize("old_default", [True, False])
def test_down_removes_its_own_cluster_and_nothing_of_another(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, old_default: bool) -> None:
    from devcluster.cluster import Cluster, named_clusters

    clusters = {n: _named(monkeypatch, n) for n in ("gpuwarden", "gwt1", "gwt10", "xgwt1")}
    for victim in clusters:
        client = _Docker(clusters, old_default)
        state = tmp_path / victim / "docker-cluster" / clusters[victim].state_dir_name
        state.mkdir(parents=True)
        Cluster(client, clusters[victim], progress=lambda _m: None,
                repo_root=tmp_path / victim).down()
        gone = {o.name for kind in (client.containers, client.networks, client.volumes)
                for o in kind.objs if o.removed}
        s = clusters[victim]
        assert gone == {s.container_name("c1"), s.container_name("s3"), s.network,
                        s.fsx_volume}, victim
        assert not state.exists()
    assert named_clusters(_Docker(clusters, old_default)) == {"gwt1", "gwt10", "xgwt1"}


class _Dockerd(threading.Thread):
    """A daemon on a unix socket that answers an exec as dockerd does when the command's
    output is ready before the client reads the response: the 101 and the first frames in one
    write (what a loaded host does), which docker-py's own exec read then never sees."""

    def __init__(self, path: str, frames: bytes, code: int) -> None:
        super().__init__(daemon=True)
        self.frames, self.code = frames, code
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(8)

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                req = b""
                while b"\r\n\r\n" not in req:
                    req += conn.recv(65536)
                head, _, body = req.partition(b"\r\n\r\n")
                length = int(re.search(rb"(?i)content-length: *(\d+)", head)[1]) \
                    if re.search(rb"(?i)content-length", head) else 0
                while len(body) < length:
                    body += conn.recv(65536)
                path = head.split(b" ")[1].decode()
                if path.endswith("/start"):
                    conn.sendall(b"HTTP/1.1 101 UPGRADED\r\nContent-Type: application/vnd.docker"
                                 b".raw-stream\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
                                 + self.frames)
                    continue
                doc = {"Id": "e1"} if path.endswith("/exec") else {"ExitCode": self.code}
                data = json.dumps(doc).encode()
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(data), data))


def _frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


@pytest.fixture
def dockerd(tmp_path: Path) -> Iterator[Callable[[bytes, int], object]]:
    docker = pytest.importorskip("docker")
    daemons: list[_Dockerd] = []

    def start(frames: bytes, code: int) -> object:
        path = str(tmp_path / f"d{len(daemons)}.sock")
        d = _Dockerd(path, frames, code)
        d.start()
        daemons.append(d)
        client = docker.DockerClient(base_url=f"unix://{path}", version="1.41", timeout=10)
        return docker.models.containers.Container(attrs={"Id": "c1", "Name": "/c1"},
                                                  client=client)
    yield start
    for d in daemons:
        d.server.close()


def test_an_exec_whose_output_came_with_the_response_headers_is_read_whole(
        dockerd: Callable[[bytes, int], object]) -> None:
    # Under the parallel e2e run, `sbatch --parsable` "printed" no job id with exit 0, a
    # written file read back empty, and frames lost their alignment ("100 is not a valid
    # stream"): docker-py never read what http.client had buffered with the headers.
    from devcluster import exec as dexec

    container = dockerd(_frame(1, b"4242\n") + _frame(2, b"warn\n") + _frame(1, b"x" * 70000), 3)
    got = dexec.run_in(container, ["sbatch", "--parsable"])
    assert (got.rc, got.out, got.err) == (3, "4242\n" + "x" * 70000, "warn\n")


def test_an_exec_stream_cut_inside_a_frame_is_an_error_not_short_output(
        dockerd: Callable[[bytes, int], object]) -> None:
    from devcluster import exec as dexec

    container = dockerd(_frame(1, b"4242\n")[:-2], 0)
    with pytest.raises(dexec.ExecOutputLost, match="of 5 bytes|inside a frame"):
        dexec.run_in(container, ["sbatch", "--parsable"])
