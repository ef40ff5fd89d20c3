"""Generated slurm.conf/gres.conf/topology.conf lines, checked against golden files."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.config import ClusterConfig
from gpuwarden.slurmconf import render as slurmconf

GOLDEN = Path(__file__).parent.parent / "golden"


def render_all(cluster: ClusterConfig, autodetect: bool) -> str:
    return "".join(slurmconf.render(p, cluster, autodetect=autodetect) for p in slurmconf.PARTS)


@pytest.mark.parametrize(
    ("name", "cluster", "autodetect"),
    [
        ("default-8x8.conf", ClusterConfig(), True),
        ("testcluster-16.conf",
         ClusterConfig(nodes=16, gpu_device_dir="/opt/fakegpu"), False),
        ("uneven-10-per-3.conf",
         ClusterConfig(nodes=10, nodes_per_leaf=3, gpus_per_node=4, gpu_type="a100"), False),
    ],
)
def test_rendered_lines_match_golden_files(name: str, cluster: ClusterConfig, autodetect: bool) -> None:
    text = render_all(cluster, autodetect)
    path = GOLDEN / name
    if os.environ.get("GPUWARDEN_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_every_node_is_in_exactly_one_leaf() -> None:
    lay = slurmconf.layout(replace(ClusterConfig(), nodes=1000, nodes_per_leaf=16))
    seen = [n for leaf in lay.leaves for n in leaf.nodes]
    assert sorted(seen) == sorted(lay.nodes) and len(seen) == 1000
    assert len(lay.leaves) == 63 and lay.spine.switches_expr == "leaf[1-63]"


def test_single_gpu_nodes_name_one_file() -> None:
    lay = slurmconf.layout(ClusterConfig(gpus_per_node=1))
    assert lay.gpu_files == "/dev/nvidia0"


def test_unknown_part_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown part"):
        slurmconf.render("cgroup.conf", ClusterConfig())
