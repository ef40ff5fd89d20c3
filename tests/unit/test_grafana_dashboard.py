"""The Grafana dashboard `install-files` ships (grafana/gpuwarden.json): importable (valid JSON,
a Prometheus data source variable, panels that fit the grid), every panel with a query, every
query valid PromQL reading only catalogued metrics, and each returning series when Prometheus
holds what gpuwarden's producers write.

The PromQL checks need promtool: skipped with the reason where it is not installed, a failure
under CI=true (`scripts/host-deps.sh promtool` installs it)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tests.prom import CATALOGUE, DASHBOARD, metric_names, run

BOARD: dict[str, Any] = json.loads(DASHBOARD.read_text())
PANELS: list[dict[str, Any]] = BOARD["panels"]
DS_UID = "${DS_PROMETHEUS}"
# Grafana's own variables, as a query would see them over a default 7-day view.
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "7d"}


def _queries() -> list[tuple[str, str]]:
    """(a rule name for the query, its PromQL with Grafana's variables filled in)."""
    out = []
    for panel in PANELS:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((f"panel{panel['id']}_{target['refId']}", expr))
    return out


def test_it_imports_with_a_prometheus_data_source_to_choose() -> None:
    assert BOARD["uid"] == "gpuwarden" and BOARD["title"]
    assert BOARD["schemaVersion"] >= 38  # Grafana 10.0 writes 38, 11 writes 39 and later
    (var,) = [v for v in BOARD["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert (var["type"], var["query"]) == ("datasource", "prometheus")
    for panel in PANELS:
        assert panel["datasource"] == {"type": "prometheus", "uid": DS_UID}, panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"], panel["title"]


def test_every_panel_has_a_query_and_a_place_of_its_own() -> None:
    ids = [p["id"] for p in PANELS]
    assert len(ids) == len(set(ids))
    taken: set[tuple[int, int]] = set()
    for panel in PANELS:
        assert panel["title"] and panel["description"], panel
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
        g = panel["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, panel["title"]
        cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                 for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & taken, f"{panel['title']} overlaps another panel"
        taken |= cells


def test_the_queries_read_only_catalogued_metrics_and_show_what_the_issue_asks() -> None:
    used: set[str] = set()
    for name, expr in _queries():
        assert "$" not in expr, (name, expr)  # no variable a site's Grafana would not have
        names = metric_names(expr)
        assert names and names <= CATALOGUE, (name, names - CATALOGUE)
        used |= names
    # Fleet health by state, drains by hook, drained nodes by owner and age, lemons, MTTF,
    # placement outcomes and snapshot age, gating off and self errors by node.
    assert {"gpuwarden_slurm_nodes", "gpuwarden_health_drains_total",
            "gpuwarden_node_drained_since_timestamp_seconds", "gpuwarden_lemon_nodes_flagged",
            "gpuwarden_lemon_nodes_held", "gpuwarden_lemon_drains_total",
            "gpuwarden_fleet_mttf_hours", "gpuwarden_placement_jobs",
            "gpuwarden_placement_snapshot_timestamp_seconds", "gpuwarden_health_gating_enabled",
            "gpuwarden_health_self_error"} <= used


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    rules = tmp_path / "dashboard.rules.json"  # JSON is YAML: promtool reads it as rules
    rules.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:{name}", "expr": expr} for name, expr in _queries()]}]}))
    res = run("check", "rules", str(rules))
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"SUCCESS: {len(_queries())} rules found" in res.stdout


# What the producers write for a small fleet: c1 healthy, c2 critical with its drain held and
# gating off on a self error, c3 warning, c4 unknown; the admin host's placement and lemon files.
# One sample a minute for 3 hours (counters rising).
_C = 'instance="{n}:9100",job="node"'
FLEET = [
    *(s for n, status in (("c1", 0), ("c2", 2), ("c3", 1), ("c4", 3)) for s in (
        (f'gpuwarden_health_status{{{_C.format(n=n)},node="{n}"}}', f"{status}x180"),
        (f'gpuwarden_check_status{{{_C.format(n=n)},check="xid",gpu="0"}}', f"{status}x180"),
        (f"gpuwarden_health_timestamp_seconds{{{_C.format(n=n)}}}", "0+60x180"),
        (f'gpuwarden_health_self_error{{{_C.format(n=n)},reason="slurm"}}',
         f"{int(n == 'c2')}x180"),
        (f"gpuwarden_health_last_success_timestamp_seconds{{{_C.format(n=n)}}}",
         "0x180" if n == "c2" else "0+60x180"),
        (f'gpuwarden_health_gating_enabled{{{_C.format(n=n)},node="{n}"}}',
         f"{int(n != 'c2')}x180"),
        (f'gpuwarden_health_drains_total{{{_C.format(n=n)},node="{n}",hook="periodic"}}',
         "0+1x180"),
        (f'gpuwarden_health_resumes_total{{{_C.format(n=n)},node="{n}"}}', "0+1x180"),
        (f'gpuwarden_health_drains_held_total{{{_C.format(n=n)},node="{n}"}}', "0+1x180"),
        (f'gpuwarden_health_drain_held{{{_C.format(n=n)},node="{n}"}}', f"{int(n == 'c2')}x180"),
        (f'gpuwarden_slurm_node_info{{{_C.format(n="admin")},node="{n}"}}', "1x180"),
        (f'gpuwarden_ckpt_tier0_bytes{{{_C.format(n=n)},node="{n}"}}', "1e9x180"),
        (f'gpuwarden_ckpt_tier0_steps{{{_C.format(n=n)},node="{n}"}}', "2x180"),
        (f'gpuwarden_ckpt_last_save_timestamp_seconds{{{_C.format(n=n)},node="{n}"}}',
         "0+60x180"),
        (f'gpuwarden_ckpt_durable_lag_seconds{{{_C.format(n=n)},node="{n}",user_bucket="3"}}',
         "0+30x180"),
        (f'gpuwarden_ckpt_tier0_entries_skipped{{{_C.format(n=n)},node="{n}"}}', "0x180"),
        (f'gpuwarden_ckpt_tier0_scan_complete{{{_C.format(n=n)},node="{n}"}}', "1x180"),
        (f'gpuwarden_ckpt_squatters_moved_total{{{_C.format(n=n)},node="{n}"}}', "0+1x180"),
        (f'gpuwarden_ckpt_stageins_total{{{_C.format(n=n)},node="{n}",outcome="staged"}}',
         "0+1x180"),
    )),
    *((f'gpuwarden_slurm_nodes{{{_C.format(n="admin")},state="{state}"}}', f"{count}x180")
      for state, count in (("idle", 2), ("allocated", 1), ("drained_health", 1))),
    (f'gpuwarden_placement_jobs{{{_C.format(n="admin")},outcome="placed"}}', "5x180"),
    (f'gpuwarden_launch_nodes_lost{{{_C.format(n="admin")},job_state="running"}}', "1x180"),
    (f'gpuwarden_placement_rounds_total{{{_C.format(n="admin")},outcome="ok"}}', "0+12x180"),
    (f"gpuwarden_placement_snapshot_timestamp_seconds{{{_C.format(n='admin')}}}", "0+60x180"),
    (f'gpuwarden_node_drained_since_timestamp_seconds{{{_C.format(n="admin")},node="c2",'
     'owner="health"}', "600x180"),
    (f"gpuwarden_lemon_scan_last_success_timestamp_seconds{{{_C.format(n='admin')}}}", "0x180"),
    (f"gpuwarden_lemon_nodes_flagged{{{_C.format(n='admin')}}}", "1x180"),
    (f"gpuwarden_lemon_nodes_held{{{_C.format(n='admin')}}}", "1x180"),
    (f"gpuwarden_lemon_drains_total{{{_C.format(n='admin')}}}", "0+1x180"),
    *((f'gpuwarden_fleet_mttf_hours{{{_C.format(n="admin")},gpus="{size}"}}', f"{h}x180")
      for size, h in (("1", 2000), ("8", 250))),
]


def test_the_fleet_is_the_catalogue() -> None:
    assert {re.match(r"\w+", s).group() for s, _ in FLEET} == CATALOGUE  # type: ignore[union-attr]


def test_every_query_returns_series_from_what_the_producers_write(tmp_path: Path) -> None:
    """Each query made an alert that fires when the query returns anything; promtool's unit
    test says which did not."""
    rules = tmp_path / "dashboard.rules.json"
    rules.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": [
        {"alert": name, "expr": f"count({expr}) > 0"} for name, expr in _queries()]}]}))
    cases = tmp_path / "dashboard.test.json"
    cases.write_text(json.dumps({
        "rule_files": [rules.name], "evaluation_interval": "1m",
        "tests": [{"interval": "1m",
                   "input_series": [{"series": s, "values": v} for s, v in FLEET],
                   "alert_rule_test": [{"eval_time": "2h", "alertname": name,
                                        "exp_alerts": [{"exp_labels": {}}]}
                                       for name, _ in _queries()]}]}))
    res = run("test", "rules", str(cases))
    assert res.returncode == 0, res.stdout + res.stderr
