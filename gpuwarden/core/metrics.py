"""Every Prometheus series gpuwarden writes, declared once, and the node_exporter textfiles
they go to.

The names, types, labels and meanings are a contract with the alert rules and the dashboard
(docs: health.md, placement.md, lemons.md "Metrics"): change one only with them. Conventions:
units in names, `_total` for counters, `_timestamp_seconds` for times, and bounded label
sets only: a label with a fixed set of values declares it (`Metric.values`), and a `node`
label must be a Slurm node name; anything else (a job field, a reason text) never becomes a
label value: `render` refuses it.

prometheus_client renders the text and is imported only when a file is rendered: the prolog's
fast path and the hooks' import path never load it (about 0.1-0.3 s: http.server, ssl, ...).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.safefs import atomic_write, ensure_private_dir

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric as Family

GAUGE, COUNTER = "gauge", "counter"
# A Slurm node name (gpuwarden.slurm.client.check_node_name's rule; core cannot import it).
_NODE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")

# gpuwarden's own failures are filed under these (health.store.SELF_REASONS).
SELF_REASONS = ("config", "slurm", "state", "internal", "deadline")
HOOKS = ("prolog", "epilog", "periodic")  # gpuwarden.slurm.reasons.ORIGINS
OWNERS = ("health", "lemon")
NODE_STATES = ("idle", "allocated", "mixed", "drained_health", "drained_lemon", "drained_other",
               "down", "other")
ROUND_OUTCOMES = ("ok", "failed")
JOB_OUTCOMES = ("placed", "excluded", "user_set", "relaxed", "shadow", "unchanged")
# "partial": some of the node's ranks not staged; "nothing": a requeued job with no step to stage.
STAGEIN_OUTCOMES = ("staged", "partial", "failed", "nothing")
LOST_JOB_STATES = ("running", "pending")
USER_BUCKETS = tuple(str(i) for i in range(8))  # gpuwarden.ckpt.nodescan.BUCKETS


@dataclass(frozen=True)
class Metric:
    name: str  # as exposed: a counter's ends in _total
    kind: str  # GAUGE or COUNTER
    help: str
    labels: tuple[str, ...] = ()
    # The only values a label may take, where the set is fixed.
    values: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False, compare=False)
    # A `node` label value must be a Slurm node name (False: only escaped, as it always was).
    node_names: bool = True

    def __post_init__(self) -> None:
        if self.kind not in (GAUGE, COUNTER):
            raise ValueError(f"{self.name}: kind {self.kind!r}")
        if (self.kind == COUNTER) != self.name.endswith("_total"):
            raise ValueError(f"{self.name}: a counter's name, and only a counter's, ends in _total")


# Node side: `[health] prom_dir` on each compute node.
# (The verdict's node was checked where the verdict was made: gpuwarden.hooks.entry.Env.node.)
HEALTH_STATUS = Metric("gpuwarden_health_status", GAUGE,
                       "Node verdict: 0 ok, 1 warning, 2 critical, 3 unknown.", ("node",),
                       node_names=False)
CHECK_STATUS = Metric("gpuwarden_check_status", GAUGE, "Per-check status (same scale).",
                      ("check", "gpu"))
HEALTH_TIMESTAMP = Metric("gpuwarden_health_timestamp_seconds", GAUGE,
                          "When the verdict was made.")
SELF_ERROR = Metric("gpuwarden_health_self_error", GAUGE,
                    "1 when gpuwarden itself failed in its last run (the reason label says "
                    "where), else 0.", ("reason",), {"reason": SELF_REASONS})
LAST_SUCCESS = Metric("gpuwarden_health_last_success_timestamp_seconds", GAUGE,
                      "When a gpuwarden health run last ended without a self error.")
GATING_ENABLED = Metric("gpuwarden_health_gating_enabled", GAUGE,
                        "1 when this node's health gating may drain it; 0 when [health] drain "
                        "= false or gating is off (a self error).", ("node",))
DRAINS = Metric("gpuwarden_health_drains_total", COUNTER,
                "Drains health gating made on this node, by the hook that made them.",
                ("node", "hook"), {"hook": HOOKS})
RESUMES = Metric("gpuwarden_health_resumes_total", COUNTER,
                 "Drains of its own health gating resumed on this node.", ("node",))
DRAINS_HELD = Metric("gpuwarden_health_drains_held_total", COUNTER,
                     "Drains of this node the blast-radius cap refused.", ("node",))
DRAIN_HELD = Metric("gpuwarden_health_drain_held", GAUGE,
                    "1 while this node has a failing verdict whose drain the blast-radius cap "
                    "held (a fault waiting), else 0.", ("node",))

# Node side, checkpointing: written by the periodic check from root's own reading of the
# node's tier 0 (gpuwarden.ckpt.nodescan) and the prolog's counts.
TIER0_BYTES = Metric("gpuwarden_ckpt_tier0_bytes", GAUGE,
                     "Bytes allocated to complete checkpoint steps in this node's tier 0 "
                     "(node memory: the ranks' own steps and peers' replicas).", ("node",))
TIER0_STEPS = Metric("gpuwarden_ckpt_tier0_steps", GAUGE,
                     "Complete checkpoint steps held in this node's tier 0.", ("node",))
LAST_SAVE = Metric("gpuwarden_ckpt_last_save_timestamp_seconds", GAUGE,
                   "When the newest step in this node's tier 0 was committed (0: none held).",
                   ("node",))
DURABLE_LAG = Metric("gpuwarden_ckpt_durable_lag_seconds", GAUGE,
                     "How long ranks have saved to tier 0 without the shared tier keeping up "
                     "(newest tier-0 step's commit less the newest durable one's; 0: caught "
                     "up), worst rank of the users in the bucket (uid mod 8). Only with a "
                     "shared tier.", ("node", "user_bucket"), {"user_bucket": USER_BUCKETS})
TIER0_SKIPPED = Metric("gpuwarden_ckpt_tier0_entries_skipped", GAUGE,
                       "Entries the last scan of tier 0 and the shared tier did not read "
                       "(not a job directory's, not its owner's, a link, past a bound).",
                       ("node",))
SCAN_COMPLETE = Metric("gpuwarden_ckpt_tier0_scan_complete", GAUGE,
                       "1 when the last scan read the whole tier-0 spool; 0 when it stopped at "
                       "a bound or its time, or failed (then only this and the counters are "
                       "written).", ("node",))
SQUATTERS = Metric("gpuwarden_ckpt_squatters_moved_total", COUNTER,
                   "Entries under a starting job's checkpoint directory names that were "
                   "not its user's, moved aside by the prolog.", ("node",))
STAGEINS = Metric("gpuwarden_ckpt_stageins_total", COUNTER,
                  "Stage-ins of a requeued job's checkpoint into tier 0 by the prolog, by "
                  "outcome (staged; partial: some of the node's ranks not staged; failed; "
                  "nothing: no step to stage).", ("node", "outcome"),
                  {"outcome": STAGEIN_OUTCOMES})

# Admin host: its `[health] prom_dir`.
SNAPSHOT_TIMESTAMP = Metric("gpuwarden_placement_snapshot_timestamp_seconds", GAUGE,
                            "When the placement snapshot job_submit.lua reads was last written "
                            "(0: none); stale, the filter lets jobs through unchanged.")
ROUNDS = Metric("gpuwarden_placement_rounds_total", COUNTER,
                "Placement daemon rounds since it started, by outcome.", ("outcome",),
                {"outcome": ROUND_OUTCOMES})
JOBS = Metric("gpuwarden_placement_jobs", GAUGE,
              "Pending and running gang-sized jobs in placement partitions, by what the "
              "job_submit filter (or the daemon) did to them, as last read.", ("outcome",),
              {"outcome": JOB_OUTCOMES})
SLURM_NODES = Metric("gpuwarden_slurm_nodes", GAUGE, "Slurm nodes by state class.", ("state",),
                     {"state": NODE_STATES})
DRAINED_SINCE = Metric("gpuwarden_node_drained_since_timestamp_seconds", GAUGE,
                       "Nodes out of service under a gpuwarden drain, since when (Slurm's "
                       "reason time).", ("node", "owner"), {"owner": OWNERS})
NODE_INFO = Metric("gpuwarden_slurm_node_info", GAUGE,
                   "1 for every node Slurm knows that is up (not down, not powered off, not "
                   "FUTURE): the nodes that should report.", ("node",))
LAUNCH_NODES_LOST = Metric("gpuwarden_launch_nodes_lost", GAUGE,
                           "Nodes the `gpuwarden launch` launchers of jobs Slurm lists named "
                           "lost (their job's Comment): of running jobs, each now runs on a "
                           "spare; of pending ones, requeued once the spares ran out.",
                           ("job_state",), {"job_state": LOST_JOB_STATES})
LEMON_LAST_SUCCESS = Metric("gpuwarden_lemon_scan_last_success_timestamp_seconds", GAUGE,
                            "When a lemon scan last ended cleanly (0: never seen).")
LEMON_FLAGGED = Metric("gpuwarden_lemon_nodes_flagged", GAUGE,
                       "Lemons found by the last scan.")
LEMON_HELD = Metric("gpuwarden_lemon_nodes_held", GAUGE,
                    "Lemons of the last scan whose drain the blast-radius cap held.")
LEMON_DRAINS = Metric("gpuwarden_lemon_drains_total", COUNTER, "Lemon drains made.")
FLEET_MTTF = Metric("gpuwarden_fleet_mttf_hours", GAUGE,
                    "Mean time to failure of jobs by size (runs of gpus/2 < n <= gpus GPUs) "
                    "over the last lemon scan's history; a size with no failure has no "
                    "series.", ("gpus",))

# Each textfile and its series, in the order written.
FILES: dict[str, tuple[Metric, ...]] = {
    "gpuwarden.prom": (HEALTH_STATUS, CHECK_STATUS, HEALTH_TIMESTAMP),
    "gpuwarden_self.prom": (SELF_ERROR, LAST_SUCCESS),
    "gpuwarden_gating.prom": (GATING_ENABLED, DRAINS, RESUMES, DRAINS_HELD, DRAIN_HELD),
    "gpuwarden_ckpt.prom": (TIER0_BYTES, TIER0_STEPS, LAST_SAVE, DURABLE_LAG, TIER0_SKIPPED,
                            SCAN_COMPLETE, SQUATTERS, STAGEINS),
    "gpuwarden_placement.prom": (SNAPSHOT_TIMESTAMP, ROUNDS, JOBS, SLURM_NODES, DRAINED_SINCE,
                                 NODE_INFO, LAUNCH_NODES_LOST),
    "gpuwarden_lemon.prom": (LEMON_LAST_SUCCESS, LEMON_FLAGGED, LEMON_HELD, LEMON_DRAINS,
                             FLEET_MTTF),
}
CATALOGUE: tuple[Metric, ...] = tuple(m for ms in FILES.values() for m in ms)

# A sample: its label values (in Metric.labels' order) and its value.
Sample = tuple[tuple[str, ...], float]


class MetricsError(GpuwardenError):
    """A textfile that cannot be rendered (prometheus_client missing, a bad label value)."""


class LabelError(MetricsError):
    """A label value outside its bounded set: never written."""


def node_label(name: str) -> bool:
    """May ``name`` be a `node` label value (a Slurm node name)?"""
    return bool(_NODE.match(name))


def _check(metric: Metric, labels: tuple[str, ...]) -> None:
    if len(labels) != len(metric.labels):
        raise LabelError(f"{metric.name}: {len(labels)} label values for {metric.labels}")
    for key, value in zip(metric.labels, labels, strict=True):
        allowed = metric.values.get(key)
        if allowed is not None and value not in allowed:
            raise LabelError(f"{metric.name}: {key}={value!r} is not one of {allowed}")
        if key == "node" and metric.node_names and not node_label(value):
            raise LabelError(f"{metric.name}: node={value!r} is not a Slurm node name")


def _family(metric: Metric, samples: Iterable[Sample]) -> Family:
    from prometheus_client.metrics_core import (  # noqa: PLC0415 - see the module doc
        CounterMetricFamily,
        GaugeMetricFamily,
    )

    fam: Family
    if metric.kind == COUNTER:
        fam = CounterMetricFamily(metric.name, metric.help, labels=metric.labels)
    else:
        fam = GaugeMetricFamily(metric.name, metric.help, labels=metric.labels)
    for labels, value in samples:
        _check(metric, labels)
        fam.add_metric(list(labels), float(value))
    return fam


def render(file: str, samples: Mapping[Metric, Iterable[Sample]]) -> bytes:
    """The text of ``file`` (a name in FILES): every series of it, in its order, with the
    samples given (none for a series left out). Raises LabelError for a label value outside
    its set, MetricsError without prometheus_client, ValueError for a series that is not the
    file's."""
    own = FILES[file]
    stray = [m.name for m in samples if m not in own]
    if stray:
        raise ValueError(f"{file}: not its series: {', '.join(stray)}")
    try:
        from prometheus_client.exposition import generate_latest  # noqa: PLC0415
        from prometheus_client.registry import Collector, CollectorRegistry  # noqa: PLC0415
    except ImportError as exc:
        raise MetricsError(f"cannot write {file}: {exc} (prometheus-client, a dependency of "
                           "gpuwarden: pip install prometheus-client, or Debian's "
                           "python3-prometheus-client)") from None
    families = [_family(m, samples.get(m, ())) for m in own]

    class _Fixed(Collector):
        def collect(self) -> Iterable[Family]:
            return families

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed())
    return generate_latest(registry)


def write_textfile(directory: str, file: str, data: bytes) -> None:
    """node_exporter's textfile: root writes it, node_exporter only reads it, so its directory
    (made 0755 if missing) is root's alone, reached without a user's link; the file is
    replaced atomically (complete or absent). Raises OSError or StateDirError."""
    ensure_private_dir(directory, mode=0o755)
    atomic_write(directory, file, data, 0o644)


def write(directory: str, file: str, samples: Mapping[Metric, Iterable[Sample]]) -> None:
    """`render` then `write_textfile`: raises OSError or a GpuwardenError (StateDirError,
    MetricsError)."""
    write_textfile(directory, file, render(file, samples))


def value_of(text: bytes, metric: Metric) -> float | None:
    """The value of ``metric``'s one unlabelled sample in a textfile gpuwarden wrote (to carry
    a timestamp over from the last run), without prometheus_client; None when absent."""
    for line in text.decode(errors="replace").splitlines():
        if line.startswith(metric.name + " "):
            try:
                return float(line.split()[1])
            except (IndexError, ValueError):
                return None
    return None

