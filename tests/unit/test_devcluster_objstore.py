"""The test cluster's object-store site (GPUWARDEN_SITE=objstore): no /fsx anywhere, checkpoints
on node memory, peers and S3 with the site secret (the S3 link's shaping:
test_devcluster_s3shape.py)."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from devcluster import spec
from devcluster.cluster import Cluster, rendered
from gpuwarden.ckpt.jobkey import parse_keys
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _spec(monkeypatch: pytest.MonkeyPatch, site: str | None) -> spec.Spec:
    for var in ("GPUWARDEN_NODES", "GPUWARDEN_CLUSTER_NAME", "GPUWARDEN_SUBNET"):
        monkeypatch.delenv(var, raising=False)
    if site is None:
        monkeypatch.delenv("GPUWARDEN_SITE", raising=False)
    else:
        monkeypatch.setenv("GPUWARDEN_SITE", site)
    return spec.from_env()


def _files(s: spec.Spec) -> dict[str, str]:
    return rendered(s, REPO, "AK", "SK", "dbpw", "ab" * 32)


def test_the_default_site_is_fsx_and_a_site_name_is_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert _spec(monkeypatch, None).site == "fsx"
    assert _spec(monkeypatch, "objstore").site == "objstore"
    with pytest.raises(ConfigError, match="GPUWARDEN_SITE"):
        _spec(monkeypatch, "lustre")


def test_an_objstore_site_checkpoints_to_s3_with_the_site_secret_and_mounts_nothing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(_spec(monkeypatch, "objstore"))
    conf = tomllib.loads(files["gpuwarden.toml"])
    ckpt = conf["ckpt"]
    assert "shared_root" not in ckpt
    assert ckpt["s3_bucket"] == "gpuwarden" and ckpt["key_file"] == "/etc/gpuwarden/ckpt.key"
    assert ckpt["stage_in_s3_env"] == "/etc/gpuwarden/s3-stagein.env"
    CkptConfig(**ckpt)  # the config gpuwarden accepts: s3 without a shared tier needs the key
    assert conf["health"]["expected"]["mounts"] == []
    assert "/fsx" not in files["gpuwarden.toml"]
    # The secret as the prolog reads it (jobkey's site file).
    [(kid, key)] = parse_keys(files["ckpt.key"].encode(), "ckpt.key", comments=True)
    assert kid == "k1" and key == bytes.fromhex("ab" * 32)


def test_an_fsx_site_is_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    files = _files(_spec(monkeypatch, "fsx"))
    conf = tomllib.loads(files["gpuwarden.toml"])
    assert conf["ckpt"] == {"shared_root": "/fsx/gpuwarden-ckpt"}
    assert conf["health"]["expected"]["mounts"] == [{"path": "/fsx", "canary": ".canary/{node}"}]
    assert "ckpt.key" not in files


class _Containers:
    def __init__(self) -> None:
        self.runs: list[dict[str, object]] = []

    def run(self, *args: object, **kwargs: object) -> None:
        self.runs.append(kwargs)


class _Client:
    def __init__(self) -> None:
        self.containers = _Containers()

        class _Api:
            api_version = "1.43"
        self.api = _Api()


@pytest.mark.parametrize(("site", "fsx"), [("fsx", True), ("objstore", False)])
def test_only_an_fsx_site_mounts_the_shared_volume_and_shaped_roles_get_net_admin(
        monkeypatch: pytest.MonkeyPatch, site: str, fsx: bool) -> None:
    pytest.importorskip("docker")
    s = _spec(monkeypatch, site)
    client = _Client()
    c = Cluster(client, s, progress=lambda _: None, repo_root=REPO)
    for host, role in (("c1", "node"), ("slurmctld", "slurmctld"), ("s3", "s3")):
        c._run(host, role, "img", "hash", "10.0.0.1", {})
    node, ctld, s3 = client.containers.runs
    for kw in (node, ctld):
        binds = [v["bind"] for v in kw["volumes"].values()]  # type: ignore[attr-defined]
        assert ("/fsx" in binds) is fsx
    assert s3["cap_add"] == ["NET_ADMIN"]
    assert node["cap_add"] is None and ctld["cap_add"] is None
    assert node["environment"]["GPUWARDEN_SITE"] == site  # type: ignore[index]


def test_dataclass_replace_keeps_the_site(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _spec(monkeypatch, "objstore")
    assert dataclasses.replace(s, name="gwo0").site == "objstore"


def test_each_workers_objstore_cluster_has_an_address_block_of_its_own() -> None:
    workers = [f"gw{letter}{n}" for letter in "tuvwxy" for n in range(16)]
    objstores = [spec.objstore_name(f"gw{letter}{n}") for letter in "tv" for n in range(4)]
    assert objstores[:2] == ["gwt0o", "gwt1o"]
    slots = [spec.slot(name) for name in workers + objstores]
    assert len(set(slots)) == len(slots)
    assert all(96 <= spec.slot(n) < 112 for n in objstores)
    assert 112 <= spec.slot("mycluster") < 128
    assert spec.WORKER_NAME_RE.fullmatch("gwv2o")  # `down --workers` removes them too
