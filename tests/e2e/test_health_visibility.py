"""Issue 11 item 4 in the real cluster: health gating is never silently off. The hooks find
Slurm's commands without PATH (as slurmd runs them), and a node whose gating is off shows in
`gpuwarden nodes` on the controller, from the marker each node keeps in its Slurm Extra."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from devcluster.harness import Harness
from gpuwarden.health import marker
from tests.e2e.test_foundation import sinfo_reasons, wait_for
from tests.e2e.test_health import nodes

pytestmark = pytest.mark.timeout(300)
HOOK = "/opt/gpuwarden/prolog/gpuwarden-healthcheck"
CONFIG = "/etc/gpuwarden/gpuwarden.toml"
USED = ("c6", "c7")


def healthcheck_without_path(h: Harness, node: str) -> None:
    # slurmd passes no PATH: `env -i` runs the hook with an empty environment.
    h.exec(node, ["env", "-i", HOOK], timeout=60).check("healthcheck without PATH")


@pytest.fixture
def clean(cluster: Harness) -> Iterator[Harness]:
    yield cluster
    for node in USED:
        cluster.clear_gpu_faults(node)
        cluster.sh(node, f"test -f /tmp/good.toml && cp /tmp/good.toml {CONFIG}; "
                   "rm -f /var/lib/gpuwarden/*.json")
        n = nodes(cluster)[node]
        if n.drained or n.down:
            cluster.exec("slurmctld", ["scontrol", "update", f"nodename={node}", "state=resume"])
        cluster.exec("slurmctld", ["scontrol", "update", f"nodename={node}", "extra="])


def test_the_health_check_finds_slurm_without_path_drains_and_resumes(clean: Harness) -> None:
    h = clean
    h.set_gpu("c6", 1, ecc_uncorrected_volatile=2)
    healthcheck_without_path(h, "c6")
    assert sinfo_reasons(h)["c6"] == \
        "gpuwarden: periodic: 2 uncorrectable ECC errors on GPU 1 [health]"
    h.clear_gpu_faults("c6")
    # The drain is recognised from its reason alone, even with the counters gone.
    h.sh("c6", "rm -f /var/lib/gpuwarden/counters.json").check("drop counters")
    for _ in range(6):
        healthcheck_without_path(h, "c6")
        if "c6" not in sinfo_reasons(h):
            break
    assert "c6" not in sinfo_reasons(h)
    m = marker.decode(nodes(h)["c6"].extra)
    assert m is not None and m.status == "OK" and m.off == ""


def test_a_broken_config_shows_in_gpuwarden_nodes_on_the_controller(clean: Harness) -> None:
    h = clean
    h.sh("c7", f"cp {CONFIG} /tmp/good.toml && printf '[health]\\ndrian = true\\n' > {CONFIG}"
         ).check("break config")
    res = h.exec("c7", ["env", "-i", HOOK], timeout=60)
    assert res.rc == 0 and "OFF on this node" in res.err
    out = h.gpuwarden("slurmctld", "nodes").check("nodes").out
    line = next(ln for ln in out.splitlines() if ln.startswith("c7 "))
    assert "health gating off since" in line and "config" in line
    rows = {r["name"]: r for r in json.loads(h.gpuwarden("slurmctld", "nodes", "--json").out)}
    assert rows["c7"]["health"]["off"] == "config"
    h.sh("c7", f"cp /tmp/good.toml {CONFIG}").check("restore config")
    healthcheck_without_path(h, "c7")
    wait_for(lambda: "gating off" not in next(
        ln for ln in h.gpuwarden("slurmctld", "nodes").out.splitlines() if ln.startswith("c7 ")),
        30, "the marker clears")


def test_selftest_passes_on_a_ready_node(clean: Harness) -> None:
    res = clean.sh("c6", "SLURMD_NODENAME=c6 gpuwarden health selftest", timeout=120)
    assert res.rc == 0, res.out + res.err
    assert "dry run periodic" in res.out and "FAIL" not in res.out
