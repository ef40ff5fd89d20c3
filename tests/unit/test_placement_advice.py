"""Issue 39 item 6: advice never repeats what is already set.

A 3-node site with one healthy node per leaf switch: `placement explain -N 2` said the job
"may wait up to 300 s for 2 nodes under 2 leaf switches ... submit with --switches=2", the
very count the filter set, and a wait no placement of 2 nodes can need (any 2 nodes sit under
at most 2 leaves). What the user is told (at submit, in the comment) and `explain`'s advice
name only things the user can change that differ from what is set, or say plainly that
nothing helps.
"""

from __future__ import annotations

import re
import time
from dataclasses import replace
from pathlib import Path

from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.config.placement import PartitionPolicy, PlacementConfig
from gpuwarden.placement import snapshot
from gpuwarden.placement.advice import advise
from gpuwarden.placement.decide import Decision, JobRequest, decide, most_nodes
from gpuwarden.placement.snapshot import FITS_NOW, NO_FIT, PartitionView, Snapshot
from gpuwarden.slurm import topology
from tests.unit.test_placement import node, run_filter

# The admin's first day: three nodes, each under a leaf switch of its own.
THREE_LEAVES = """\
SwitchName=leaf1 Nodes=c1
SwitchName=leaf2 Nodes=c2
SwitchName=leaf3 Nodes=c3
SwitchName=spine Switches=leaf[1-3]
"""


def three(now: float = 1_800_000_000.0) -> Snapshot:
    nodes = [node(f"c{i}") for i in (1, 2, 3)]
    return snapshot.build(PlacementConfig(), topology.parse(THREE_LEAVES), nodes,
                          {"gpu": ("c1", "c2", "c3")}, (), 7, now, None)


def test_one_healthy_node_per_leaf_tells_the_user_no_wait_and_no_repeat() -> None:
    d = decide(three(), JobRequest(2, True, gpus_per_node=8), now=1_800_000_000)
    # Any 2 nodes meet --switches=2: nothing to wait for, so nothing promised.
    assert d.user_message == "" and d.comment is None
    assert "--switches=2" not in d.user_message
    lines = advise(three(), JobRequest(2, True, gpus_per_node=8), d)
    assert len(lines) == 1 and lines[0].startswith("nothing to change: ")
    assert "one per leaf switch" in lines[0] and "--switches=2" not in lines[0].split(":")[0]


def test_the_lua_filter_tells_the_user_nothing_there_either(tmp_path: Path) -> None:
    s = three(now=time.time())
    [got] = run_filter(tmp_path, snapshot.render(s), [JobRequest(2, True)])
    assert not [x for x in got["logs"] if str(x).startswith("user: ")]  # type: ignore[attr-defined]
    assert "comment" not in got


def test_explain_on_the_three_leaf_site_says_plainly_nothing_helps(tmp_path: Path) -> None:
    topo = tmp_path / "topology.conf"
    topo.write_text(THREE_LEAVES)
    conf = tmp_path / "gpuwarden.toml"
    conf.write_text(f'[placement]\ntopology_file = "{topo}"\n'
                    f'snapshot_file = "{tmp_path / "gpuwarden-placement.lua"}"\n')
    from tests.fakes import FakeSlurm

    class Slurm(FakeSlurm):
        def partitions(self) -> dict[str, tuple[str, ...]]:
            return {"gpu": tuple(self.table)}

    slurm = Slurm({f"c{i}": node(f"c{i}") for i in (1, 2, 3)})
    res = CliRunner().invoke(cli, ["--config", str(conf), "placement", "explain", "-N", "2"],
                             obj=Context(client_factory=lambda cfg: slurm))
    assert res.exit_code == 0, res.output
    assert "tells the user" not in res.output
    assert "advice: nothing to change: " in res.output


def test_a_real_hold_names_a_larger_switch_count_than_the_one_set() -> None:
    # Two leaves of 4 and 3 healthy: 6 nodes need 2 leaves; the advice is --switches=6.
    from tests.unit.test_placement import snap

    s = snap(lemons=("c6",))
    job = JobRequest(6, True)
    d = decide(s, job)
    assert d.switches == 2 and "--switches=6" in d.user_message
    lines = advise(s, job, d)
    assert any(x.startswith("--switches=6: ") for x in lines)
    assert any(x.startswith("-N 4: ") for x in lines)  # fewer nodes fit under one leaf


def test_too_few_healthy_with_the_users_n_already_fitting_names_what_makes_it_more(
        tmp_path: Path) -> None:
    # c3 drained: 2 healthy. -N 2 --gpus 24 at 8 per node makes 3 nodes: "ask for at most 2
    # (-N)" repeated the user's own -N 2. The Lua filter tells the user the same line.
    nodes = [node("c1"), node("c2"), node("c3", ("IDLE", "DRAIN"), "maintenance")]
    s = snapshot.build(PlacementConfig(), topology.parse(THREE_LEAVES), nodes,
                       {"gpu": ("c1", "c2", "c3")}, (), 7, time.time(), None)
    job = JobRequest(2, True, gpus_per_job=24, gpus_per_node=8)
    d = decide(s, job)
    assert "at most 2 (-N)" not in d.user_message
    assert d.user_message.endswith("its --gpus, -n or -N maximum make it 3: ask for at most 2 "
                                   "nodes' worth to keep off them")
    assert_no_repeat(s, job, d, advise(s, job, d))
    [got] = run_filter(tmp_path, snapshot.render(s), [job])
    assert [x for x in got["logs"] if str(x).startswith("user: ")] == [  # type: ignore[attr-defined]
        "user: " + d.user_message]


# ---- the property, over generated cluster states ----------------------------------------------
_SWITCHES = re.compile(r"--switches=(\d+)")
_N = re.compile(r"(?:at most (\d+) \(-N\)|(?:^|[ (])-N (\d+))")
_PART = re.compile(r"(?:^|[ (])-p (\S+?)[:;,)]")
_PER_NODE = re.compile(r"at most (\d+) \(--gpus-per-node\)|--gpus-per-node=(\d+)")


def assert_no_repeat(s: Snapshot, job: JobRequest, d: Decision, lines: list[str]) -> None:
    part = job.partition.split(",")[0] if job.partition else s.default_partition
    set_now = {x for x in (d.switches, job.req_switch) if x is not None}
    assert lines, "explain must always say something: advice or that nothing helps"
    for text in [d.user_message, *lines]:
        for m in _SWITCHES.finditer(text):
            assert int(m.group(1)) not in set_now, (text, d)
            assert d.switches is None or int(m.group(1)) > d.switches, (text, d)
        for m in _N.finditer(text):
            value = int(m.group(1) or m.group(2))
            assert 1 <= value < job.min_nodes, (text, job)
        for m in _PART.finditer(text):
            assert m.group(1) != part, (text, job)
        for m in _PER_NODE.finditer(text):
            assert int(m.group(1) or m.group(2)) < job.gpus_per_node, (text, job)
    view = s.partitions.get(part)
    if view is not None and d.switches is not None:
        nodes = job.min_nodes if job.max_nodes not in (None, job.min_nodes) else most_nodes(job)
        if d.switches >= nodes or not d.wait_s:
            assert "may wait" not in d.user_message, (d, job)  # any placement meets it
    nothing = [x for x in lines if x.startswith("nothing to change: ")]
    assert not nothing or len(lines) == 1, lines  # either advice, or plainly none


@st.composite
def views(draw: st.DrawFn, name: str) -> PartitionView:
    capacity = tuple(sorted(draw(st.lists(st.integers(1, 6), max_size=5)), reverse=True))
    healthy = sum(capacity)
    suspects = draw(st.integers(0, 3))
    down = draw(st.integers(0, 3))
    in_service = healthy + suspects
    size = max(1, in_service + down)
    per_node = draw(st.sampled_from([4, 8]))
    policy = PartitionPolicy(mode=draw(st.sampled_from(["preferred", "required", "off"])),
                             wait_s=draw(st.sampled_from([0, 60, 300])),
                             shadow=draw(st.booleans()))
    fit: tuple[tuple[int, int], ...] = ()
    if draw(st.booleans()) and healthy:
        fit = ((1, FITS_NOW), (max(1, healthy // 2), draw(st.sampled_from(
            [FITS_NOW, NO_FIT, 1_800_000_100]))))
        fit = tuple(sorted(set(fit)))
    return PartitionView(name, policy, capacity, healthy, size, in_service, ((per_node, size),),
                         (), (), fit)


@st.composite
def states(draw: st.DrawFn) -> tuple[Snapshot, JobRequest]:
    names = draw(st.lists(st.sampled_from(["gpu", "big", "old"]), min_size=1, max_size=3,
                          unique=True))
    parts = {n: draw(views(n)) for n in names}
    s = Snapshot(7, 1_800_000_000.0, 120, names[0], draw(st.sampled_from(["tree", "block"])),
                 parts, {})
    min_nodes = draw(st.integers(1, 12))
    elastic = draw(st.booleans())
    job = JobRequest(
        min_nodes, draw(st.booleans()) or True,
        partition=draw(st.sampled_from(["", *names, ",".join(names)])),
        req_switch=draw(st.one_of(st.none(), st.integers(1, 6))),
        contiguous=draw(st.booleans()) and draw(st.booleans()),
        max_nodes=min_nodes + draw(st.integers(1, 4)) if elastic else min_nodes,
        gpus_per_job=draw(st.sampled_from([0, 0, 8, 24, 40])),
        gpus_per_node=draw(st.sampled_from([0, 4, 8, 16])),
        tasks=draw(st.sampled_from([0, 0, 4, 16])))
    if job.gpus_per_job:
        job = replace(job, max_nodes=None)  # the count then comes from --gpus (and -n)
    return s, job


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(states())
def test_advice_never_repeats_what_is_already_set(state: tuple[Snapshot, JobRequest]) -> None:
    s, job = state
    d = decide(s, job, now=1_800_000_000)
    assert_no_repeat(s, job, d, advise(s, job, d))


def test_the_lua_filter_tells_users_what_decide_does_over_generated_clusters(
        tmp_path: Path) -> None:
    # The message gating and the too-few line are in both: they must agree word for word on
    # random small sites (one to three nodes per leaf, some drained, some suspect).
    import random

    rng = random.Random(39)
    for round_ in range(12):
        leaves = [[f"c{i}{j}" for j in range(rng.randint(1, 3))] for i in range(rng.randint(1, 4))]
        text = "".join(f"SwitchName=leaf{i} Nodes={','.join(ns)}\n"
                       for i, ns in enumerate(leaves))
        names = [n for ns in leaves for n in ns]
        nodes = [node(n, ("IDLE", "DRAIN"), "maintenance") if rng.random() < 0.25 else
                 node(n, comment="gpuwarden: would drain: xid 79") if rng.random() < 0.15 else
                 node(n) for n in names]
        s = snapshot.build(PlacementConfig(), topology.parse(text), nodes,
                           {"gpu": tuple(names)}, (), 7, time.time(), None)
        jobs = [JobRequest(rng.randint(2, len(names) + 1), True,
                           gpus_per_job=rng.choice([0, 0, 8 * (len(names) + 1)]),
                           gpus_per_node=8) for _ in range(8)]
        d = tmp_path / f"r{round_}"
        d.mkdir()
        results = run_filter(d, snapshot.render(s), jobs)
        for job, got in zip(jobs, results, strict=True):
            want = decide(s, job)
            said = [str(x)[6:] for x in got["logs"] if str(x).startswith("user: ")]  # type: ignore[attr-defined]
            assert said == ([want.user_message] if want.user_message else []), (text, job)
            assert_no_repeat(s, job, want, advise(s, job, want))
