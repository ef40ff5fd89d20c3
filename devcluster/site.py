"""A plain Slurm site in containers, with no gpuwarden: what the admin-guide test installs on.

The cluster image's Debian Slurm, started by docker-cluster/site/site.sh from the site's own
slurm.conf (docker-cluster/site/): one head (MariaDB, slurmdbd, slurmctld) and four GPU nodes
on two leaf switches' worth of names. Nothing of the test cluster's templates, entrypoint or
gpuwarden install is used; the built wheel is only put where the guide says (`/path/to/dist`),
and every host mounts one shared directory at /fsx, the site's shared filesystem.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devcluster import image, wheel
from devcluster.exec import ExecResult, run_in
from gpuwarden.core.errors import GpuwardenError

PREFIX = "gwsite"
LABEL = "gpuwarden.plainsite"
SUBNET = "172.30.0.0/24"
HEAD = "head"
NODES = ("gn1", "gn2", "gn3", "gn4")
NODES_PER_LEAF = 2
GPUS = 8
# Where the wheel is inside the containers: the guide's placeholder, literally.
DIST = "/path/to/dist"
FSX = "/fsx"  # the shared filesystem the guide's step 6 names

Progress = Callable[[str], None]


class SiteError(GpuwardenError):
    pass


class PlainSite:
    def __init__(self, client: Any, repo_root: Path, work_dir: Path,
                 progress: Progress = print, name: str = PREFIX, subnet: str = SUBNET) -> None:
        self.client = client
        self.root = repo_root
        self.work = work_dir
        self.progress = progress
        # One site per test cluster (spec.Spec.site_name): named sites never carry the LABEL
        # key, which older checkouts' down() removes whatever it is set to.
        self.name, self.subnet, self.network = name, subnet, f"{name}-net"
        self.labels = {LABEL: "1"} if name == PREFIX else {f"{LABEL}.name": name}
        self.label_filter = LABEL if name == PREFIX else f"{LABEL}.name={name}"

    @property
    def hosts(self) -> list[str]:
        return [HEAD, *NODES]

    def _address(self, host: str) -> str:
        return str(ipaddress.ip_network(self.subnet).network_address + 10 + self.hosts.index(host))

    def _seed(self) -> Path:
        seed = self.work / "seed"
        seed.mkdir(parents=True)
        src = self.root / "docker-cluster" / "site"
        for name in ("slurm.conf", "gres.conf", "cgroup.conf", "site.sh"):
            shutil.copy(src / name, seed / name)
        dbd = (src / "slurmdbd.conf.in").read_text() + f"StoragePass={secrets.token_hex(12)}\n"
        (seed / "slurmdbd.conf").write_text(dbd)
        (seed / "munge.key").write_bytes(secrets.token_bytes(1024))
        for path in seed.iterdir():
            path.chmod(0o755 if path.name == "site.sh" else 0o644)
        return seed

    def up(self, timeout: float = 240.0) -> None:
        import docker  # noqa: PLC0415 - developer tooling only

        t0 = time.monotonic()
        self.down()
        tag = self.plain_image(image.ensure_image(self.client, self.root, self.progress))
        self.progress("building the gpuwarden wheel (the guide's step 1)")
        built = wheel.build(self.root, self.work / "dist")
        seed = self._seed()
        # The site's shared filesystem (its /fsx): one host directory mounted on every host,
        # as a parallel filesystem is; the guide's step 6 makes the spool in it.
        fsx = self.work / "fsx"
        fsx.mkdir(mode=0o755, exist_ok=True)
        fsx.chmod(0o755)
        ipam = docker.types.IPAMConfig(pool_configs=[docker.types.IPAMPool(subnet=self.subnet)])
        self.client.networks.create(self.network, driver="bridge", ipam=ipam, labels=self.labels)
        hosts = {h: self._address(h) for h in self.hosts}
        for host in self.hosts:
            role = "head" if host == HEAD else "node"
            self.client.containers.run(
                tag, ["/etc/site-seed/site.sh", role],
                name=f"{self.name}-{host}", hostname=host, detach=True, labels=self.labels,
                volumes={
                    str(seed): {"bind": "/etc/site-seed", "mode": "ro"},
                    str(built.parent): {"bind": DIST, "mode": "ro"},
                    str(fsx): {"bind": FSX, "mode": "rw"},
                },
                extra_hosts={h: a for h, a in hosts.items() if h != host},
                network=self.network,
                networking_config={self.network: docker.types.EndpointConfig(
                    version=self.client.api.api_version, ipv4_address=hosts[host],
                    aliases=[host])},
                init=True,
            )
        self.progress(f"waiting: the site's {len(NODES)} nodes are idle")
        self.wait_for(self.nodes_idle, "every node idle", timeout)
        self.progress(f"plain site up in {time.monotonic() - t0:.0f} s")

    def plain_image(self, cluster_tag: str, timeout: float = 900.0) -> str:
        """The cluster image less what the guide installs (docker-cluster/site/plain.sh), made
        once and kept (docker commit), named for the cluster image and the script."""
        import docker  # noqa: PLC0415 - developer tooling only

        script = self.root / "docker-cluster" / "site" / "plain.sh"
        digest = hashlib.sha256(script.read_bytes()).hexdigest()[:10]
        tag = f"{PREFIX}-image:{cluster_tag.rsplit(':', 1)[-1]}-{digest}"
        try:
            self.client.images.get(tag)
            return tag
        except docker.errors.ImageNotFound:
            pass
        self.progress(f"making the plain site's image {tag} (once: the guide's packages "
                      "removed from the cluster image)")
        # The script as an argument, not a mount: a committed mount point becomes a volume of
        # the image, which every later container would have to mount over the file.
        c = self.client.containers.run(
            cluster_tag, ["/bin/bash", "-c", script.read_text()], detach=True,
            labels=self.labels, network_mode="none")
        try:
            rc = c.wait(timeout=timeout).get("StatusCode")
            if rc != 0:
                logs = c.logs(tail=20).decode(errors="replace")
                raise SiteError(f"making the plain site's image failed (exit {rc}):\n{logs}")
            repo, _, name = tag.partition(":")
            c.commit(repository=repo, tag=name)
        finally:
            c.remove(force=True)
        return tag

    def down(self) -> None:
        for c in self.client.containers.list(all=True, filters={"label": self.label_filter}):
            c.remove(force=True, v=True)
        for net in self.client.networks.list(names=[self.network]):
            if net.name == self.network:  # the name filter matches substrings
                net.remove()

    def container(self, host: str) -> Any:
        return self.client.containers.get(f"{self.name}-{host}")

    def exec(self, host: str, argv: list[str], timeout: float = 60.0, user: str = "") -> ExecResult:
        return run_in(self.container(host), argv, timeout=timeout, user=user)

    def sh(self, host: str, script: str, timeout: float = 60.0, user: str = "") -> ExecResult:
        return self.exec(host, ["bash", "-euo", "pipefail", "-c", script], timeout=timeout,
                         user=user)

    def write(self, host: str, path: str, text: str, mode: str = "0644") -> None:
        """Write a root-owned file in one host (what an admin's editor leaves)."""
        run_in(self.container(host), ["bash", "-c", f'umask 022; cat > "$0" && chmod {mode} "$0"',
                                      path], timeout=30, stdin_text=text).check(f"write {path}")

    def read(self, host: str, path: str) -> str:
        return self.exec(host, ["cat", path], timeout=30).check(f"read {path}").out

    def diagnostics(self) -> str:
        """The logs an admin would read first: each daemon's last lines."""
        out = [f"--- {HEAD}: entrypoint\n{self.logs(HEAD, 10)}"]
        for host, path in [(HEAD, "/var/log/slurm/slurmctld.log"),
                           (HEAD, "/var/log/gpuwarden-placement.log"),
                           *((n, "/var/log/slurm/slurmd.log") for n in NODES)]:
            res = self.exec(host, ["tail", "-n", "15", path], timeout=20)
            out.append(f"--- {host}: {path}\n{res.out or res.err}")
        return "\n".join(out)

    def logs(self, host: str, tail: int = 30) -> str:
        return str(self.container(host).logs(tail=tail).decode(errors="replace"))

    def wait_for(self, probe: Callable[[], str], what: str, timeout: float) -> None:
        """Poll ``probe`` (empty string: done; else what it still sees) until ``timeout``."""
        deadline = time.monotonic() + timeout
        last = ""
        while True:
            for c in self.client.containers.list(all=True, filters={"label": self.label_filter}):
                if c.status not in ("running", "created"):
                    raise SiteError(f"{c.name} is {c.status}: "
                                    f"{self.logs(c.name.removeprefix(self.name + '-'))}")
            last = probe()
            if not last:
                return
            if time.monotonic() > deadline:
                raise SiteError(f"timed out after {timeout:.0f} s waiting for {what} (last: "
                                f"{last})\n{self.diagnostics()}")
            time.sleep(1.0)

    def nodes_idle(self) -> str:
        res = self.exec(HEAD, ["sinfo", "-h", "-N", "-o", "%N %t"], timeout=20)
        if res.rc != 0:
            return res.err.strip() or f"exit {res.rc}"
        states = dict(line.split() for line in res.out.splitlines() if line.strip())
        busy = [f"{n}={states.get(n, 'unknown')}" for n in NODES if states.get(n) != "idle"]
        return ", ".join(busy)
