"""The test cluster's slurm.conf, rendered as `python -m devcluster up` renders it,
passes `slurm-conf --check` for every feature with what its /etc/slurm holds beside it."""

from __future__ import annotations

import shutil
from pathlib import Path

import jinja2
import pytest

from gpuwarden.config import ClusterConfig
from gpuwarden.slurmconf import render as slurmconf
from tests.unit.test_slurmconf_check import ALL, run

REPO = Path(__file__).resolve().parents[2]


def rendered(cluster: ClusterConfig) -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(REPO / "docker-cluster" / "templates"),
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
        autoescape=False)  # config files, not HTML
    return str(env.get_template("slurm.conf.j2").render(
        layout=slurmconf.layout(cluster), fragment=slurmconf.render("slurm.conf", cluster),
        health_check_interval=300))


@pytest.mark.parametrize("version", [(24, 11), None])
def test_the_test_clusters_slurm_conf_passes_for_every_feature(
        tmp_path: Path, version: tuple[int, int] | None) -> None:
    cluster = ClusterConfig()
    (tmp_path / "slurm.conf").write_text(rendered(cluster))
    (tmp_path / "topology.conf").write_text(slurmconf.render("topology.conf", cluster))
    # The entrypoint installs gpuwarden's own filter beside it.
    shutil.copy(REPO / "plugins" / "job_submit.lua", tmp_path / "job_submit.lua")
    code, out = run(tmp_path / "slurm.conf", ALL, wait_s=60, version=version)
    assert code == 0, "\n".join(out)
    assert all(line.startswith(("#", "ok ", "nothing missing")) for line in out), out
