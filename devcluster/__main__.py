"""`python -m devcluster up|down|status|image`: the test cluster's task runner."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace

import click

from devcluster.spec import from_env
from gpuwarden.core.errors import GpuwardenError


def _client() -> object:
    try:
        import docker  # noqa: PLC0415
    except ImportError:
        raise click.ClickException("the docker SDK is missing: run `make venv` first") from None
    try:
        client = docker.from_env(timeout=600)
        client.ping()
    except Exception as exc:
        raise click.ClickException(f"cannot reach the Docker daemon ({exc}); is it running?") from None
    return client


_T0 = time.monotonic()


def _progress(msg: str) -> None:
    click.echo(f"[{time.monotonic() - _T0:6.1f}s] {msg}", err=True)


@click.group()
def main() -> None:
    """Manage the dockerized Slurm test cluster."""


def _cluster() -> object:
    from devcluster.cluster import Cluster  # noqa: PLC0415

    return Cluster(_client(), from_env(), progress=_progress)


@main.command()
@click.option("--timeout", default=240.0, show_default=True, help="seconds to wait for readiness")
def up(timeout: float) -> None:
    """Build the image if needed, start the cluster, wait until it works."""
    try:
        _cluster().up(timeout=timeout)  # type: ignore[attr-defined]
    except GpuwardenError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--workers", is_flag=True,
              help="instead: every cluster the parallel e2e tests made (gwt<n>, gwv<n>) and its "
                   "admin-guide site")
def down(workers: bool) -> None:
    """Remove the cluster's containers, network, shared volume and rendered config
    (GPUWARDEN_CLUSTER_NAME picks the cluster; the default one is `gpuwarden`)."""
    from pathlib import Path  # noqa: PLC0415

    from devcluster.cluster import Cluster, named_clusters  # noqa: PLC0415
    from devcluster.site import LABEL as SITE_LABEL  # noqa: PLC0415
    from devcluster.site import PlainSite  # noqa: PLC0415
    from devcluster.spec import WORKER_NAME_RE, subnet_for  # noqa: PLC0415

    client = _client()
    spec = from_env()
    if not workers:
        Cluster(client, spec, progress=_progress).down()
        _progress(f"cluster {spec.name} removed")
        return
    root = Path(__file__).resolve().parents[1]
    # Found by label, and by the state dirs a run left in this checkout.
    names = {n for n in named_clusters(client) if WORKER_NAME_RE.fullmatch(n)}
    names |= {p.name.removeprefix(".state-") for p in (root / "docker-cluster").glob(".state-*")
              if WORKER_NAME_RE.fullmatch(p.name.removeprefix(".state-"))}
    # A site left by a killed run, its cluster already gone.
    key = f"{SITE_LABEL}.name"
    sites = client.containers.list(all=True, filters={"label": key})  # type: ignore[attr-defined]
    left = {c.labels.get(key, "").removesuffix("site") for c in sites}
    names |= {n for n in left if WORKER_NAME_RE.fullmatch(n)}
    for name in sorted(names):
        worker = replace(spec, name=name, subnet=subnet_for(name))
        Cluster(client, worker, progress=_progress).down()
        PlainSite(client, root, root, progress=_progress, name=worker.site_name,
                  subnet=worker.site_subnet).down()
        _progress(f"cluster {name} and its site removed")
    if not names:
        _progress("no cluster of the parallel e2e tests found")


@main.command()
def demo() -> None:
    """Run the demo scenario on the running cluster (start it with `up`)."""
    from devcluster import demo as demo_mod  # noqa: PLC0415
    from devcluster.harness import Harness  # noqa: PLC0415

    cluster = _cluster()
    try:
        cluster.wait_ready(timeout=60)  # type: ignore[attr-defined]
        demo_mod.run(Harness(cluster), click.echo)  # type: ignore[arg-type]
    except GpuwardenError as exc:
        raise click.ClickException(f"{exc}\nIs the cluster up? Run `make cluster-up`.") from None


@main.command()
def image() -> None:
    """Build the cluster image only (needs root and debootstrap)."""
    from pathlib import Path  # noqa: PLC0415

    from devcluster import image as img  # noqa: PLC0415

    try:
        tag = img.ensure_image(_client(), Path(__file__).resolve().parents[1], _progress,
                              slurm=from_env().slurm)
    except GpuwardenError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(tag)


def _s3_run() -> Callable[[str, list[str]], tuple[int, str]]:
    """How to run a command in one of the cluster's containers."""
    from devcluster.cluster import Cluster  # noqa: PLC0415

    cluster = Cluster(_client(), from_env(), progress=_progress)

    def run(host: str, argv: list[str]) -> tuple[int, str]:
        got = cluster.exec(host, argv, timeout=30)
        return got.rc, got.out + got.err
    return run


@main.command("shape-s3")
@click.argument("delay")
@click.argument("rate")
def shape_s3(delay: str, rate: str) -> None:
    """Shape the S3 link like a remote object store's: DELAY each way (15ms) and RATE (1gbit),
    downloads shared by every node, uploads capped per node; a relay in the s3 container
    (docs/test-cluster.md). Again with other values: replaced."""
    from devcluster import s3shape  # noqa: PLC0415

    try:
        how = s3shape.Shape(delay, rate)
        s3shape.shape(_s3_run(), how)
    except s3shape.ShapeError as exc:
        raise click.ClickException(str(exc)) from None
    _progress(f"S3 link shaped: {delay} each way, {rate}")


@main.command("unshape-s3")
def unshape_s3() -> None:
    """Take the S3 link's shaping off."""
    from devcluster import s3shape  # noqa: PLC0415

    try:
        s3shape.unshape(_s3_run())
    except s3shape.ShapeError as exc:
        raise click.ClickException(str(exc)) from None
    _progress("S3 link unshaped")


if __name__ == "__main__":
    sys.exit(main())
