"""Bring the dockerized Slurm cluster up and down, and wait until it really works."""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2

from devcluster import image, wheel
from devcluster.exec import ExecResult, run_in
from devcluster.spec import DEFAULT_NAME, NAME_LABEL, Spec
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.slurm.parse import parse_nodes
from gpuwarden.slurmconf import render as slurmconf
from gpuwarden.slurmconf.keys import parse_release, parse_version

log = logging.getLogger(__name__)

Progress = Callable[[str], None]
# The working tree inside every container (read-only): test-only files such as fake-gpu-job.
# gpuwarden itself is installed from the wheel under /opt/gpuwarden (docker-cluster/entrypoint.sh).
SRC = "/src/gpuwarden"
VENV_PYTHON = "/opt/gpuwarden/venv/bin/python"
# Network, shared volume and container names are the cluster's own (Spec.network, fsx_volume,
# container_name): several clusters run side by side.
FSX_PATH = "/fsx"
# /dev/shm of each node (checkpoint tier 0); part of the config hash.
NODE_SHM = "1g"
S3_BUCKET = "gpuwarden"


class ClusterError(GpuwardenError):
    pass


PRIVATE = ("slurmdbd.conf", "s3.json", "s3.env", "ckpt.key")  # 0600 in the state dir
CKPT_KID = "k1"  # the objstore site's one site-secret key id (jobkey's `<kid> <hex>` line)


def rendered(spec: Spec, root: Path, access: str, secret: str, db_password: str,
             ckpt_secret: str) -> dict[str, str]:
    """The cluster's config files by name (the state dir's), from its spec and secrets. An
    objstore site has one more: the checkpoint site secret (`[ckpt] key_file`)."""
    cl = spec.cluster
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(root / "docker-cluster" / "templates"),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,  # noqa: S701 - config files, not HTML
    )
    files = {
        "slurm.conf": env.get_template("slurm.conf.j2").render(
            layout=slurmconf.layout(cl), fragment=slurmconf.render("slurm.conf", cl),
            health_check_interval=spec.health_check_interval_s),
        "gres.conf": slurmconf.render("gres.conf", cl, autodetect=False),
        "topology.conf": slurmconf.render("topology.conf", cl),
        "cgroup.conf": (root / "docker-cluster/templates/cgroup.conf").read_text(),
        "slurmdbd.conf": env.get_template("slurmdbd.conf.j2").render(db_password=db_password),
        "gpuwarden.toml": env.get_template("gpuwarden.toml.j2").render(
            gpus=cl.gpus_per_node, cluster=cl, site=spec.site, bucket=S3_BUCKET),
        "s3.json": json.dumps({"identities": [{
            "name": "gpuwarden", "credentials": [{"accessKey": access, "secretKey": secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}),
        "s3.env": f"AWS_ACCESS_KEY_ID={access}\nAWS_SECRET_ACCESS_KEY={secret}\n"
                  f"GPUWARDEN_S3_ENDPOINT=http://s3:8333\nGPUWARDEN_S3_BUCKET={S3_BUCKET}\n",
    }
    if spec.site == "objstore":
        files["ckpt.key"] = f"{CKPT_KID} {ckpt_secret}\n"
    return files


def named_clusters(client: Any) -> set[str]:
    """The names of the named (non-default) clusters with a container or network on this host."""
    found = {c.labels.get(NAME_LABEL, "") for c in client.containers.list(
        all=True, filters={"label": NAME_LABEL})}
    found |= {(n.attrs.get("Labels") or {}).get(NAME_LABEL, "") for n in client.networks.list(
        filters={"label": NAME_LABEL})}
    return {name for name in found if name and name != DEFAULT_NAME}


def _repo_root() -> Path:
    return Path(__file__).resolve().parents[1]


class Cluster:
    def __init__(self, client: Any, spec: Spec, progress: Progress = print,
                 repo_root: Path | None = None) -> None:
        self.client = client
        self.spec = spec
        self.progress = progress
        self.root = repo_root or _repo_root()
        self.state_dir = self.root / "docker-cluster" / spec.state_dir_name

    # ---- rendering -------------------------------------------------------------------------
    def _secret(self, name: str, nbytes: int) -> str:
        path = self.state_dir / name
        if not path.exists():
            path.write_text(secrets.token_hex(nbytes))
            path.chmod(0o600)
        return path.read_text().strip()

    def render_state(self) -> str:
        """Write the cluster's config files; return a hash that changes when they change."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        key = self.state_dir / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
            key.chmod(0o400)
        access, secret = self._secret("s3.access", 10), self._secret("s3.secret", 20)
        files = rendered(self.spec, self.root, access, secret, self._secret("db.password", 12),
                         self._secret("ckpt.secret", 32))
        digest = hashlib.sha256()
        # The mounted working tree is part of the identity: never reuse another checkout's cluster.
        digest.update(str(self.root).encode() + b"\0")
        self.progress("building the gpuwarden wheel the nodes install")
        built = wheel.build(self.root, self.state_dir / "wheel")
        # What the containers installed: a changed tree means new containers.
        digest.update(b"wheel=" + wheel.digest(built).encode() + b"\0")
        digest.update(f"shm={NODE_SHM}".encode() + b"\0")
        # What the containers ran at start: an edited entrypoint means new containers too.
        digest.update((self.root / "docker-cluster/entrypoint.sh").read_bytes() + b"\0")
        # Containers keep the capabilities they were made with (`_run`): only s3's NET_ADMIN.
        digest.update(f"site={self.spec.site},cap=s3:NET_ADMIN".encode() + b"\0")
        for name, text in sorted(files.items()):
            path = self.state_dir / name
            path.write_text(text)
            path.chmod(0o600 if name in PRIVATE else 0o644)
            digest.update(name.encode() + b"\0" + text.encode() + b"\0")
        return digest.hexdigest()[:12]

    # ---- docker objects ------------------------------------------------------------------------
    def _containers(self) -> list[Any]:
        return list(self.client.containers.list(
            all=True, filters={"label": self.spec.label_filter}))

    def _networks(self) -> list[Any]:
        # Docker's name filter matches substrings ("gwt1-net" would list "xgwt1-net").
        return [n for n in self.client.networks.list(names=[self.spec.network])
                if n.name == self.spec.network]

    def _ensure_network(self) -> Any:
        nets = self._networks()
        if nets:
            return nets[0]
        import docker  # noqa: PLC0415 - developer tooling only

        ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=self.spec.subnet)])
        try:
            return self.client.networks.create(self.spec.network, driver="bridge", ipam=ipam,
                                               labels=self.spec.labels)
        except docker.errors.APIError as exc:
            if "overlap" not in str(exc).lower():
                raise
            raise ClusterError(
                f"cluster {self.spec.name}: its subnet {self.spec.subnet} overlaps another docker "
                f"network ({exc.explanation}); pick a free one with GPUWARDEN_SUBNET "
                "(docs/test-cluster.md)") from None

    def _run(self, host: str, role: str, tag: str, config_hash: str, ip: str,
             hosts: dict[str, str]) -> Any:
        import docker  # noqa: PLC0415

        volumes = {
            str(self.root): {"bind": SRC, "mode": "ro"},
            str(self.state_dir): {"bind": "/etc/gpuwarden-cluster", "mode": "ro"},
        }
        if role in ("node", "slurmctld") and self.spec.site == "fsx":
            volumes[self.spec.fsx_volume] = {"bind": FSX_PATH, "mode": "rw"}
        return self.client.containers.run(
            tag,
            [f"{SRC}/docker-cluster/entrypoint.sh", role],
            name=self.spec.container_name(host),
            hostname=host,
            detach=True,
            labels={**self.spec.labels, "gpuwarden.role": role, "gpuwarden.config": config_hash},
            environment={"GPUWARDEN_GPUS": str(self.spec.cluster.gpus_per_node),
                         "GPUWARDEN_SITE": self.spec.site},
            # The S3 link is shaped inside the s3 container (nft redirect to a relay:
            # devcluster.s3shape); nothing else needs NET_ADMIN.
            cap_add=["NET_ADMIN"] if role == "s3" else None,
            volumes=volumes,
            extra_hosts={h: a for h, a in hosts.items() if h != host},
            network=self.spec.network,
            networking_config={self.spec.network: docker.types.EndpointConfig(
                version=self.client.api.api_version, ipv4_address=ip, aliases=[host])},
            init=True,
            # Tier 0 of checkpoints is /dev/shm: Docker's 64 MB default holds no real state.
            shm_size=NODE_SHM if role == "node" else None,
        )

    # ---- lifecycle ----------------------------------------------------------------------------
    def up(self, timeout: float = 180.0) -> None:
        t0 = time.monotonic()
        tag = image.ensure_image(self.client, self.root, self.progress, slurm=self.spec.slurm)
        config_hash = self.render_state()
        wanted = {self.spec.container_name(h) for h in self.spec.services + self.spec.node_names}
        current = self._containers()
        reusable = (
            {c.name for c in current} == wanted
            and all(c.status == "running" and c.labels.get("gpuwarden.config") == config_hash
                    and tag in c.image.tags for c in current)
        )
        if current and not reusable:
            self.progress("cluster exists with another shape or config: recreating it")
            self.down(keep_state=True)
        if not reusable:
            self._ensure_network()
            hosts = self.spec.addresses()
            roles = {"slurmdbd": "slurmdbd", "slurmctld": "slurmctld", "s3": "s3"}
            roles.update({n: "node" for n in self.spec.node_names})
            self.progress(f"starting {len(roles)} containers from {tag}")
            # Accounting first, so slurmctld registers with a database that already knows
            # the cluster, its account and its users.
            for host in ("slurmdbd", "s3"):
                self._run(host, roles.pop(host), tag, config_hash, hosts[host], hosts)
            self._bootstrap_accounting(deadline=time.monotonic() + timeout)
            for host, role in roles.items():
                self._run(host, role, tag, config_hash, hosts[host], hosts)
        self.wait_ready(timeout=timeout)
        release = self.check_release(tag)
        self.progress(f"cluster ready in {time.monotonic() - t0:.0f} s: {release}, "
                      f"{len(self.spec.node_names)} nodes x {self.spec.cluster.gpus_per_node} GPUs")

    def check_release(self, tag: str) -> str:
        """The Slurm the cluster runs ("slurm 26.05.5"), or ClusterError when it is not the
        release GPUWARDEN_SLURM asked for: an image built from a Debian suite that has moved
        on would otherwise test another Slurm under the asked one's name."""
        wanted = parse_release(self.spec.slurm)
        seen: dict[str, str] = {}
        for host in ("slurmctld", self.spec.node_names[0]):
            res = self.exec(host, ["scontrol", "--version"], timeout=20)
            seen[host] = (res.out.strip() or res.err.strip() or f"exit {res.rc}")
            if res.rc != 0 or parse_version(res.out) != wanted:
                raise ClusterError(
                    f"GPUWARDEN_SLURM={self.spec.slurm}, but {host} of image {tag} runs "
                    f"{seen[host]!r}: the image's Debian suite carries another Slurm now. "
                    f"Rebuild it (`docker rmi {tag}`, then make cluster-up) and check "
                    "docker-cluster/image's packages, or pick the release it runs")
        return seen["slurmctld"]

    def down(self, keep_state: bool = False) -> None:
        """Remove this cluster's containers, network and volume, and no other cluster's."""
        for c in self._containers():
            c.remove(force=True, v=True)
        for net in self._networks():
            net.remove()
        for vol in self.client.volumes.list(filters={"name": self.spec.fsx_volume}):
            if vol.name == self.spec.fsx_volume:
                vol.remove(force=True)
        if not keep_state and self.state_dir.exists():
            shutil.rmtree(self.state_dir)

    # ---- readiness ----------------------------------------------------------------------------
    def container(self, host: str) -> Any:
        return self.client.containers.get(self.spec.container_name(host))

    def exec(self, host: str, argv: list[str], timeout: float = 60.0, user: str = "") -> ExecResult:
        return run_in(self.container(host), argv, timeout=timeout, user=user)

    def _fail(self, host: str, what: str) -> ClusterError:
        try:
            c = self.container(host)
            logs = c.logs(tail=25).decode(errors="replace")
            status = c.status
        except Exception as exc:
            logs, status = f"(no logs: {exc})", "missing"
        return ClusterError(
            f"{what}: container {self.spec.container_name(host)} is {status}; its last log "
            f"lines:\n{logs}\nRetry with `make cluster-down cluster-up`; see docs/test-cluster.md"
        )

    def _check_running(self) -> None:
        for c in self._containers():
            c.reload()
            if c.status != "running":
                host = c.name.removeprefix(f"{self.spec.name}-")
                raise self._fail(host, "a container stopped while the cluster came up")

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        steps: list[tuple[str, str, Callable[[], str]]] = [
            ("slurmctld", "slurmctld answers and every node is idle", self._nodes_idle),
            ("slurmdbd", "sacct answers (slurmdbd and MariaDB are up)", self._sacct_ok),
            ("s3", "the S3 server accepts a write", self._s3_ok),
        ]
        for host, what, probe in steps:
            self.progress(f"waiting: {what}")
            last = ""
            while True:
                self._check_running()
                last = probe()
                if not last:
                    break
                if time.monotonic() > deadline:
                    raise self._fail(host, f"timed out after {timeout:.0f} s waiting until {what} "
                                           f"(last: {last})")
                time.sleep(1.0)

    def _bootstrap_accounting(self, deadline: float) -> None:
        self.progress("waiting: slurmdbd answers; adding the cluster, account and users")
        name = self.spec.cluster.name
        steps = [
            ["sacctmgr", "-i", "add", "cluster", name],
            ["sacctmgr", "-i", "add", "account", "research", f"cluster={name}",
             "description=gpuwarden test users", "organization=gpuwarden"],
            ["sacctmgr", "-i", "add", "user", "root,alice,bob", "account=research",
             f"cluster={name}"],
        ]
        for argv in steps:
            while True:
                self._check_running()
                res = self.exec("slurmdbd", argv, timeout=20)
                text = res.out + res.err
                if res.rc == 0 or "Nothing new added" in text or "already exists" in text:
                    break
                if time.monotonic() > deadline:
                    raise self._fail("slurmdbd", f"`{' '.join(argv)}` kept failing: {text.strip()}")
                time.sleep(0.5)

    def _nodes_idle(self) -> str:
        res = self.exec("slurmctld", ["scontrol", "show", "nodes", "--json"], timeout=20)
        if res.rc != 0:
            return res.err.strip() or f"exit {res.rc}"
        nodes = parse_nodes(res.out)
        not_idle = [f"{n.name}={n.state_text}" for n in nodes if n.state != ("IDLE",)]
        if len(nodes) != len(self.spec.node_names):
            return f"{len(nodes)} of {len(self.spec.node_names)} nodes known"
        return ", ".join(not_idle)

    def _sacct_ok(self) -> str:
        res = self.exec("slurmctld", ["sacct", "-n", "-X", "--starttime=now-1hours"], timeout=20)
        if res.rc != 0:
            return res.err.strip() or f"exit {res.rc}"
        res = self.exec("slurmctld", ["sacctmgr", "-n", "-P", "show", "cluster", "format=cluster"],
                        timeout=20)
        if self.spec.cluster.name not in res.out.split():
            return "the cluster is not registered in slurmdbd yet"
        return ""

    def _s3_ok(self) -> str:
        node = self.spec.node_names[0]
        res = self.exec(node, [VENV_PYTHON, f"{SRC}/devcluster/s3probe.py"], timeout=30)
        return "" if res.rc == 0 else (res.err.strip().splitlines() or [f"exit {res.rc}"])[-1]
