"""The cluster image per Slurm release: GPUWARDEN_SLURM picks it, each has its own inputs and tag."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from devcluster import image, spec
from gpuwarden.core.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def _copy_inputs(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO / "docker-cluster" / "image", root / "docker-cluster" / "image")
    return root


def test_slurm_24_11_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUWARDEN_SLURM", raising=False)
    assert spec.from_env().slurm == "24.11"
    monkeypatch.setenv("GPUWARDEN_SLURM", "")
    assert spec.from_env().slurm == "24.11"


def test_gpuwarden_slurm_selects_26_05(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUWARDEN_SLURM", "26.05")
    assert spec.from_env().slurm == "26.05"


@pytest.mark.parametrize("value", ["25.05", "26.5", "latest"])
def test_an_unknown_release_is_refused_with_the_choices(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("GPUWARDEN_SLURM", value)
    with pytest.raises(ConfigError, match=r"GPUWARDEN_SLURM.*24\.11, 26\.05"):
        spec.from_env()
    with pytest.raises(image.ImageBuildError, match=r"24\.11, 26\.05"):
        image.image_tag(REPO, value)


def test_each_release_has_its_own_tag_and_inputs(tmp_path: Path) -> None:
    root = _copy_inputs(tmp_path)
    old, new = image.image_tag(root, "24.11"), image.image_tag(root, "26.05")
    assert old != new and image.image_tag(root) == old
    (root / "docker-cluster/image/26.05/customize.sh").write_text("#!/bin/sh\ntrue\n")
    assert image.image_tag(root, "24.11") == old
    assert image.image_tag(root, "26.05") != new


def test_both_images_install_the_same_packages() -> None:
    # The cluster's roles and the tests need the same tools whichever Slurm runs.
    assert set(image.packages(REPO, "26.05")) == set(image.packages(REPO, "24.11"))
    assert {"slurmctld", "slurmd", "slurmdbd", "python3-torch"} <= set(image.packages(REPO, "26.05"))


def test_a_26_05_build_bootstraps_forky_with_its_own_inputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr/sbin").mkdir(parents=True)
    (rootfs / "usr/local/bin").mkdir(parents=True)
    weed = tmp_path / "weed"
    weed.write_text("weed")
    ran: list[list[str]] = []
    customize: list[str] = []

    def fake_run(argv: list[str], what: str, timeout: float) -> None:
        ran.append(argv)
        if argv[-1] == "/customize.sh":
            customize.append((rootfs / "customize.sh").read_text())

    monkeypatch.setattr(image, "_run", fake_run)
    monkeypatch.setattr(image, "_weed_binary", lambda _cache: weed)
    image.build_rootfs(REPO, rootfs, tmp_path / "cache", lambda _msg: None, "26.05")
    first_stage = ran[0]
    assert first_stage[0] == "debootstrap" and "forky" in first_stage
    assert f"--include={','.join(image.packages(REPO, '26.05'))}" in first_stage
    assert customize == [(REPO / "docker-cluster/image/26.05/customize.sh").read_text()]
    assert not (rootfs / "customize.sh").exists()
