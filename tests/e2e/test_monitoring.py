"""Issue 38's proof in the real cluster: what gpuwarden writes reaches a real Prometheus through
node_exporter's textfile collector, its shipped alerts fire in a real Alertmanager with the node
and the evidence, and resolve; every dashboard panel's query returns series.

The rules are the shipped ones with their waits cut for tests (devcluster/monitor.py,
`test_rules`); `promtool test rules` (tests/unit/test_alert_rules.py) checks the real ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster import monitor
from devcluster.harness import TRAIN_SBATCH, Harness
from tests.e2e.test_foundation import node_state, sinfo_reasons, wait_for
from tests.e2e.test_health import periodic

pytestmark = [pytest.mark.timeout(420), pytest.mark.versions]
DASHBOARD = Path(__file__).resolve().parents[2] / "gpuwarden/sitefiles/grafana/gpuwarden.json"
CONFIG = "/etc/gpuwarden/gpuwarden.toml"


def break_config(h: Harness, node: str) -> None:
    """A typo in the node's config (an unknown key): gating is off there, and the file still
    names the textfile directory, so the node says so (docs/health.md)."""
    h.sh(node, f"cp {CONFIG} /tmp/good.toml && "
               f"sed -i 's/^\\[health\\]$/[health]\\ndrian = true/' {CONFIG} && "
               f"grep -q '^drian = true$' {CONFIG}").check("break the config")


def value(mon: monitor.Monitor, expr: str) -> float | None:
    got = mon.query(expr)
    return float(got[0]["value"][1]) if got else None


@pytest.fixture(scope="module")
def mon(cluster: Harness) -> Iterator[monitor.Monitor]:
    h = cluster
    for node in h.cluster.spec.node_names:  # every node's verdict and gating series
        periodic(h, node)
    m = monitor.start(h)
    yield m
    h.exec("slurmctld", ["pkill", "-x", "prometheus"])
    h.exec("slurmctld", ["pkill", "-f", "[p]rometheus-alertmanager"])
    for host in [*h.cluster.spec.node_names, "slurmctld"]:
        h.exec(host, ["pkill", "-f", "[p]rometheus-node-exporter"])


@pytest.fixture
def clean(cluster: Harness, mon: monitor.Monitor) -> Iterator[monitor.Monitor]:
    yield mon
    h = cluster
    for node in h.cluster.spec.node_names:
        h.clear_gpu_faults(node)
        h.sh(node, f"test -f /tmp/good.toml && mv /tmp/good.toml {CONFIG}; true")
        h.sh(node, "rm -f /var/lib/gpuwarden/*.json")
    for node, reason in sinfo_reasons(h).items():
        if reason.startswith("gpuwarden"):
            h.exec("slurmctld", ["scontrol", "update", f"nodename={node}", "state=resume"])
    h.exec("slurmctld", ["scancel", "--user=alice"])
    h.start_placement_daemon()


def test_an_xid_drain_reaches_prometheus_and_pages_with_the_node_and_evidence(
        clean: monitor.Monitor) -> None:
    mon, h = clean, clean.h
    h.inject_xid("c3", 5, 79)
    periodic(h, "c3")
    wait_for(lambda: "xid 79" in sinfo_reasons(h).get("c3", ""), 60, "c3 drained for xid 79")
    # The drain as Prometheus sees it: the node's own counter and verdict, the admin host's view.
    mon.wait(lambda: value(mon, 'gpuwarden_health_drains_total{node="c3",hook="periodic"}'),
             60, "c3's periodic drain counted")
    assert value(mon, 'gpuwarden_health_status{node="c3"}') == 2
    assert value(mon, 'gpuwarden_check_status{check="xid",gpu="5"} * on (instance) '
                      'group_left (node) gpuwarden:instance_node:info{node="c3"}') == 2
    mon.wait(lambda: mon.query('gpuwarden_node_drained_since_timestamp_seconds'
                               '{node="c3",owner="health"}'), 60, "the daemon lists c3's drain")
    (alert,) = mon.wait(lambda: mon.firing("GpuwardenNodeDrainedTooLong", node="c3"), 90,
                        "Alertmanager has GpuwardenNodeDrainedTooLong for c3")
    assert alert["labels"]["owner"] == "health" and alert["labels"]["severity"] == "warning"
    # The evidence: the node's failing checks, as its node_exporter reports them. The periodic
    # check drains first and writes its verdict after, so the alert's first rendering may
    # precede the scrape that brings it: wait for the re-rendered one.
    (alert,) = mon.wait(lambda: [a for a in mon.firing("GpuwardenNodeDrainedTooLong", node="c3")
                                 if "Failing checks on it now: xid/gpu5." in
                                 a["annotations"]["description"]], 60,
                        "the alert's description names c3's failing check")
    assert "gpuwarden drained c3 (owner=health)" in alert["annotations"]["description"]
    assert alert["annotations"]["runbook_url"].endswith("#gpuwardennodedrainedtoolong")
    # Nobody else's drain pages: an operator's drain of c4 has no series and no alert.
    h.exec("slurmctld", ["scontrol", "update", "nodename=c4", "state=drain",
                         "reason=maintenance"]).check("operator drain")
    try:
        mon.wait(lambda: value(mon, 'gpuwarden_slurm_nodes{state="drained_other"}') == 1, 60,
                 "the daemon counts c4 as drained by someone else")
        assert not mon.query('gpuwarden_node_drained_since_timestamp_seconds{node="c4"}')
        assert not mon.firing("GpuwardenNodeDrainedTooLong", node="c4")
    finally:
        h.exec("slurmctld", ["scontrol", "update", "nodename=c4", "state=resume"])
    # Fixed: two passing checks resume c3 and the alert resolves.
    h.clear_gpu_faults("c3")
    for _ in range(2):
        periodic(h, "c3")
    wait_for(lambda: "drain" not in node_state(h, "c3"), 60, "c3 back in service")
    mon.wait(lambda: value(mon, 'gpuwarden_health_resumes_total{node="c3"}'), 60,
             "c3's resume counted")
    mon.wait(lambda: not mon.firing("GpuwardenNodeDrainedTooLong", node="c3"), 90,
             "the alert for c3 resolves")


def test_gating_off_on_a_node_pages_until_its_config_is_fixed(clean: monitor.Monitor) -> None:
    mon, h = clean, clean.h
    break_config(h, "c5")
    h.exec("c5", ["/opt/gpuwarden/prolog/gpuwarden-healthcheck"], timeout=60)  # fails open
    (alert,) = mon.wait(lambda: mon.firing("GpuwardenGatingOff", node="c5"), 90,
                        "Alertmanager has GpuwardenGatingOff for c5")
    assert alert["labels"]["reason"] == "config" and alert["labels"]["severity"] == "critical"
    assert "c5" in alert["annotations"]["summary"]
    assert not [a for a in mon.alerts() if a["labels"].get("alertname") == "GpuwardenGatingOff"
                and a["labels"].get("node") != "c5"]
    h.sh("c5", f"cp /tmp/good.toml {CONFIG}").check("fix the config")
    periodic(h, "c5")
    mon.wait(lambda: not mon.firing("GpuwardenGatingOff", node="c5"), 90,
             "GpuwardenGatingOff for c5 resolves")


def test_a_stopped_placement_daemon_pages_as_a_stale_snapshot(clean: monitor.Monitor) -> None:
    mon, h = clean, clean.h
    mon.wait(lambda: mon.query("gpuwarden_placement_snapshot_timestamp_seconds"), 60,
             "the daemon's snapshot time in Prometheus")
    assert not mon.firing("GpuwardenPlacementSnapshotStale")
    h.stop_placement_daemon()
    (alert,) = mon.wait(lambda: mon.firing("GpuwardenPlacementSnapshotStale"), 120,
                        "Alertmanager has GpuwardenPlacementSnapshotStale")
    assert "fails open" in alert["annotations"]["summary"]
    h.start_placement_daemon()
    mon.wait(lambda: not mon.firing("GpuwardenPlacementSnapshotStale"), 90,
             "GpuwardenPlacementSnapshotStale resolves once the daemon writes again")


def ckpt_scanned(h: Harness, mon: monitor.Monitor, node: str) -> None:
    """The periodic check on ``node`` until Prometheus has its checkpoint scan complete with a
    lag series (a scan on a loaded host may fall short, and says so: scan_complete 0)."""
    def done() -> bool:
        periodic(h, node)
        try:  # a few scrapes (every 2 s) for this run's file
            mon.wait(lambda: mon.query(f'gpuwarden_ckpt_tier0_scan_complete{{node="{node}"}} == 1')
                     and mon.query(f'gpuwarden_ckpt_durable_lag_seconds{{node="{node}"}}'),
                     10, "this run's series")
        except AssertionError:
            return False
        return True

    try:
        wait_for(done, 150, f"{node}'s checkpoint scan complete, with a lag series")
    except AssertionError as exc:
        seen = h.sh(node, "cat /var/lib/node_exporter/textfile/gpuwarden_ckpt.prom; "
                          "ls -l /var/lib/gpuwarden/ckpt-jobs /dev/shm/gpuwarden-ckpt").out
        raise AssertionError(f"{exc}; on {node}: {seen[-3000:]}") from exc


def _panels() -> list[tuple[str, list[str]]]:
    doc = json.loads(DASHBOARD.read_text())
    out = []
    for p in doc["panels"]:
        exprs = [re.sub(r"\$__rate_interval", "1m", t["expr"]) for t in p.get("targets", [])
                 if t.get("expr")]
        if exprs:
            out.append((p.get("title", "?"), exprs))
    return out


def test_every_dashboard_panel_shows_series_from_the_live_prometheus(
        clean: monitor.Monitor) -> None:
    mon, h = clean, clean.h
    # What the panels show in a working fleet with something wrong: a drained node, a node
    # with gating off, a job running, and a lemon scan over the accounting so far.
    h.inject_xid("c6", 1, 79)
    periodic(h, "c6")
    break_config(h, "c7")
    h.exec("c7", ["/opt/gpuwarden/prolog/gpuwarden-healthcheck"], timeout=60)
    # A job checkpointing on c2 (ckpt/train.sbatch: tier 0, then the shared tier): the periodic
    # check reads its steps from c2's tier 0 and their lag behind the shared tier.
    job = h.sbatch("-N1", "-w", "c2", "--gpus-per-node=8", name="train",
                   script=[TRAIN_SBATCH, "--steps", "300", "--every", "5", "--mb", "1",
                           "--step-s", "1"])
    wait_for(lambda: 5 in h.shared_steps(job, 0), 120, "job's step 5 on the shared tier")
    ckpt_scanned(h, mon, "c2")
    # A gang job that died (rule 3: blamed on its nodes), so the scan has an MTTF to give.
    died = h.sbatch("-N2", "--gpus-per-node=1", name="died", wrap="exit 1")
    h.wait_acct(died, "FAILED", timeout=60)
    # --drain, as the timer's: only the scan that acts writes gpuwarden_lemon.prom.
    h.gpuwarden("slurmctld", "lemon", "scan", "--since", "1d", "--drain",
                timeout=120).check("lemon scan")
    empty: dict[str, list[str]] = {}

    def all_show() -> bool:
        empty.clear()
        for title, exprs in _panels():
            if not any(mon.query(e) for e in exprs):
                empty[title] = exprs
        return not empty

    try:
        mon.wait(all_show, 90, "every panel to have series")
    except AssertionError as exc:
        raise AssertionError(f"panels without series: {empty}") from exc
    # Root's reading of c2's tier 0: the job's steps (1 MiB each), their lag behind the
    # shared tier under the job user's bucket, a recent save.
    assert (value(mon, 'gpuwarden_ckpt_tier0_bytes{node="c2"}') or 0) >= 500_000
    assert (value(mon, 'gpuwarden_ckpt_tier0_steps{node="c2"}') or 0) >= 1
    lag = mon.query('gpuwarden_ckpt_durable_lag_seconds{node="c2"}')
    assert len(lag) == 1 and float(lag[0]["value"][1]) < 300, lag
    assert (value(mon, 'time() - gpuwarden_ckpt_last_save_timestamp_seconds{node="c2"}')
            or 1e9) < 300
