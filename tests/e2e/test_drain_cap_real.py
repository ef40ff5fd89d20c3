"""Issue 11 item 5 in the real cluster: the blast-radius cap reads only the nodes out of service,
ranks drains by slurmctld's stamps, and never needs the node comment."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest

from devcluster.cluster import VENV_PYTHON
from devcluster.harness import Harness
from tests.e2e.test_health import NODES, nodes, periodic

pytestmark = pytest.mark.timeout(300)

# Run on the controller host: the real client over the real commands, printed as JSON.
_PROBE = """
import json
from gpuwarden.slurm.settings import SlurmConfig
from gpuwarden.slurm.client import CliSlurmClient
from gpuwarden.slurm.runner import SubprocessRunner
c = CliSlurmClient(SlurmConfig(), SubprocessRunner())
v = c.out_of_service(also=("c3",))
print(json.dumps({"nodes": {n.name: [list(n.state), n.reason, n.reason_changed_at,
                                     list(n.partitions)] for n in v.nodes},
                  "ctld_time": v.ctld_time, "sizes": c.partition_sizes()}))
"""


@pytest.fixture
def tidy(cluster: Harness) -> Iterator[Harness]:
    yield cluster
    for node in NODES:
        cluster.clear_gpu_faults(node)
        cluster.sh(node, "rm -f /var/lib/gpuwarden/*.json").check("reset node")
    for n in nodes(cluster).values():
        if n.drained or n.down:
            cluster.exec("slurmctld", ["scontrol", "update", f"nodename={n.name}", "state=resume"])
        if n.comment:
            cluster.exec("slurmctld", ["scontrol", "update", f"nodename={n.name}", "comment="])


def test_the_client_reads_only_nodes_out_of_service_with_the_controllers_clock(
        tidy: Harness) -> None:
    h = tidy
    h.exec("slurmctld", ["scontrol", "update", "nodename=c2", "state=drain",
                         "reason=maintenance"]).check("operator drain")
    h.exec("slurmctld", ["scontrol", "update", "nodename=c7", "state=drain",
                         "reason=gpuwarden: xid 79 on GPU 5"]).check("gpuwarden drain")
    doc = json.loads(h.exec("slurmctld", [VENV_PYTHON, "-c", _PROBE]).check("probe").out)
    assert set(doc["nodes"]) == {"c2", "c7", "c3"}
    assert doc["nodes"]["c7"][1] == "gpuwarden: xid 79 on GPU 5"
    assert doc["nodes"]["c7"][2] and doc["nodes"]["c7"][3] == ["gpu"]
    assert doc["ctld_time"] >= doc["nodes"]["c7"][2]
    assert doc["sizes"] == {"gpu": 8}


def test_a_node_with_an_operators_comment_is_drained_and_keeps_it(tidy: Harness) -> None:
    h = tidy
    h.exec("slurmctld", ["scontrol", "update", "nodename=c3",
                         "comment=rack B07 u12"]).check("operator comment")
    h.set_gpu("c3", 0, ecc_uncorrected_volatile=3)
    periodic(h, "c3")
    c3 = nodes(h)["c3"]
    assert c3.drained and c3.reason.startswith("gpuwarden: ")
    assert c3.comment == "rack B07 u12"


def test_concurrent_drains_with_operator_comments_stop_at_the_cap(tidy: Harness) -> None:
    h = tidy
    faulty = ["c1", "c2", "c5", "c6", "c7"]
    for n in faulty:
        h.exec("slurmctld", ["scontrol", "update", f"nodename={n}",
                             f"comment=asset {n}"]).check("comment")
        h.set_gpu(n, 0, ecc_uncorrected_volatile=3)
    threads = [threading.Thread(target=periodic, args=(h, n)) for n in faulty]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    state = nodes(h)
    drained = [n for n in faulty if state[n].drained]
    assert len(drained) == 2, {n: (state[n].state, state[n].reason) for n in faulty}
    assert all(state[n].comment == f"asset {n}" for n in faulty)
