"""What the placement filter tells a user whose job the healthy nodes cannot hold agrees with
what Slurm then does: a job larger than its partition (in nodes, or in GPUs per node) is refused
by Slurm at submission, so no wait is promised; one that needs drained or down nodes waits; one
that needs suspect nodes may start on them. Run on the Python reference and on job_submit.lua
under lua5.1, which must say the same words."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gpuwarden.config.placement import PartitionPolicy, PlacementConfig
from gpuwarden.placement import snapshot
from gpuwarden.placement.decide import Decision, JobRequest, decide
from gpuwarden.slurm import topology
from gpuwarden.slurm.models import Node
from tests.unit.test_placement import TREE, run_filter


def node(name: str, state: tuple[str, ...] = ("IDLE",), gres: str = "gpu:h100:8",
         comment: str = "") -> Node:
    return Node(name, state, "", "", None, ("gpu",), gres, (), None, comment)


def snap(nodes: list[Node], lemons: tuple[str, ...] = (),
         partitions: dict[str, tuple[str, ...]] | None = None) -> snapshot.Snapshot:
    cfg = PlacementConfig(default=PartitionPolicy(), default_partition="gpu")
    parts = partitions or {"gpu": tuple(n.name for n in nodes)}
    return snapshot.build(cfg, topology.parse(TREE), nodes, parts, lemons, 7, time.time())


EIGHT = [node(f"c{i}") for i in range(1, 9)]
SUSPECT = [*EIGHT[:5], node("c6", comment="gpuwarden: would drain: ecc (blast-radius cap)"),
           *EIGHT[6:]]
TWO_DRAINED = [*EIGHT[:6], node("c7", ("IDLE", "DRAIN")), node("c8", ("DOWN",))]
# c1-c4 with 8 GPUs, c5-c8 with 4.
MIXED = [*EIGHT[:4], *(node(f"c{i}", gres="gpu:a100:4(S:0-1)") for i in range(5, 9))]


def both(tmp_path: Path, s: snapshot.Snapshot, job: JobRequest) -> tuple[Decision, str]:
    """The reference's decision, and what the Lua filter told the user ("" for nothing), after
    checking the filter set the same fields."""
    want = decide(s, job)
    [got] = run_filter(tmp_path, snapshot.render(s), [job])
    told = [x[len("user: "):] for x in got["logs"] if x.startswith("user: ")]  # type: ignore[attr-defined]
    assert told == ([want.user_message] if want.user_message else []), (job, got)
    assert got.get("req_switch") == (str(want.switches) if want.switches else None), job
    assert got.get("exc_nodes") == want.exc_nodes, job
    return want, told[0] if told else ""


def test_a_job_larger_than_its_partition_is_not_promised_a_wait(tmp_path: Path) -> None:
    # The case: sbatch -N 20 on an 8-node partition, which Slurm refuses.
    d, told = both(tmp_path, snap(SUSPECT), JobRequest(20, True, max_nodes=20))
    assert d.action == "pass" and d.switches is None and d.exc_nodes is None
    assert "waits" not in told and "repairs" not in told
    assert told == ("gpuwarden: this job asks for 20 nodes but partition gpu has 8 in all: "
                    "Slurm refuses it; ask for at most 8 (-N), or name a larger partition (-p)")


def test_drained_and_down_nodes_count_towards_the_partitions_size(tmp_path: Path) -> None:
    # 8 nodes, 2 out of service: an 8-node job is accepted by Slurm and waits for them.
    _, told = both(tmp_path, snap(TWO_DRAINED), JobRequest(8, True, max_nodes=8))
    assert told == ("gpuwarden: this job asks for 8 nodes and partition gpu has 6 in service "
                    "now (2 drained or down): it waits until enough are back")
    # ...and a 9-node job is refused, whatever their state.
    _, told = both(tmp_path, snap(TWO_DRAINED), JobRequest(9, True, max_nodes=9))
    assert "has 8 in all: Slurm refuses it" in told


def test_a_job_that_needs_a_suspect_node_is_told_it_may_start_on_one(tmp_path: Path) -> None:
    # Suspects are in service: Slurm starts an 8-node job now, on c6 too; nothing waits.
    d, told = both(tmp_path, snap(SUSPECT), JobRequest(8, True, max_nodes=8))
    assert d.action == "pass" and "waits" not in told
    assert told == ("gpuwarden: this job asks for 8 nodes but partition gpu has 7 healthy now: "
                    "it may start on nodes gpuwarden suspects; ask for at most 7 (-N) to keep "
                    "off them")


def test_more_gpus_per_node_than_any_node_has_is_said_and_nothing_is_set(tmp_path: Path) -> None:
    d, told = both(tmp_path, snap(EIGHT), JobRequest(2, True, max_nodes=2, gpus_per_node=16))
    assert (d.action, d.switches) == ("pass", None)  # not "would set switches=1"
    assert told == ("gpuwarden: this job asks for 16 GPUs per node but no node of partition gpu "
                    "has more than 8: Slurm refuses it; ask for at most 8 (--gpus-per-node)")


def test_only_nodes_with_enough_gpus_count_towards_the_size(tmp_path: Path) -> None:
    s = snap(MIXED)
    assert s.partitions["gpu"].gpus == ((8, 4), (4, 4))
    _, told = both(tmp_path, s, JobRequest(6, True, max_nodes=6, gpus_per_node=8))
    assert told == ("gpuwarden: this job asks for 6 nodes with 8 GPUs each but partition gpu has "
                    "4 such nodes in all: Slurm refuses it; ask for at most 4 (-N), or for "
                    "fewer GPUs per node")
    d, told = both(tmp_path, s, JobRequest(6, True, max_nodes=6, gpus_per_node=4))
    # 4 GPUs per node: all 8 nodes can hold it; no refusal, only why it may wait.
    assert d.switches == 2 and told.startswith("gpuwarden: this job may wait up to 300 s for 6 "
                                               "nodes under 2 leaf switches")


def test_a_node_whose_gres_cannot_be_read_stops_any_gpu_claim(tmp_path: Path) -> None:
    s = snap([*EIGHT[:7], node("c8", gres="gpu:h100:lots")])
    assert s.partitions["gpu"].gpus == ()
    d, told = both(tmp_path, s, JobRequest(2, True, max_nodes=2, gpus_per_node=16))
    # c8 may have 16: no refusal (left to Slurm), only why it may wait.
    assert d.switches == 1 and "refuses" not in told and "may wait up to 300 s" in told


def test_a_job_naming_several_partitions_is_told_nothing(tmp_path: Path) -> None:
    # Slurm may run it in the other partition: neither a refusal nor a wait is ours to say.
    s = snap(SUSPECT, partitions={"gpu": tuple(n.name for n in SUSPECT), "big": ()})
    for n in (8, 20):
        d, told = both(tmp_path, s, JobRequest(n, True, partition="gpu,big", max_nodes=n))
        assert d.action == "pass" and told == ""


@pytest.mark.parametrize("exclude", ["c1", "c[1-3]", "x["])
def test_an_exclude_that_may_leave_too_few_promises_nothing(tmp_path: Path, exclude: str) -> None:
    # With c1 excluded only 7 nodes may be left for an 8-node job: Slurm may refuse it.
    _, told = both(tmp_path, snap(SUSPECT), JobRequest(8, True, max_nodes=8, exc_nodes=exclude))
    assert told == ""


def test_an_elastic_job_is_sized_by_its_minimum(tmp_path: Path) -> None:
    # -N 2-20 on 8 nodes: Slurm accepts it (and trims the maximum), so nothing is refused.
    d, told = both(tmp_path, snap(EIGHT), JobRequest(2, True, max_nodes=20))
    assert "refuses" not in told and "refuses" not in d.why


def test_the_snapshot_carries_size_service_and_gpus_per_node() -> None:
    text = snapshot.render(snap([*TWO_DRAINED, node("c9", gres="")],
                                partitions={"gpu": tuple(f"c{i}" for i in range(1, 10))}))
    assert " size=9 in_service=7 healthy=6 gpus=8:8,0:1 capacity=4,2\n" in text


@pytest.mark.parametrize("gres,gpus", [
    ("gpu:h100:8", 8), ("gpu:8", 8), ("gpu", 1), ("gpu:h100", 1), ("", 0), ("(null)", 0),
    ("gpu:h100:8(S:0-1),shard:h100:64", 8), ("gpu:a100:4,gpu:v100:2", 6),
    ("gpu:h100:8(S:0,1)", 8), ("gpu:h100:1K", None), ("gpu:", None), ("gpu:a:b:8", None),
])
def test_gpus_per_node_are_read_from_slurms_gres(gres: str, gpus: int | None) -> None:
    assert snapshot.gpus_per_node(gres) == gpus


@pytest.mark.parametrize("mangle,needle", [
    (lambda t: t.replace("gpus=8:8", "gpus=8:"), "gpus is not a list"),
    (lambda t: t.replace("gpus=8:8", "gpus=8:8,,"), "gpus is not a list"),
    (lambda t: t.replace(" size=8", ""), "not a valid partition line"),
])
def test_a_malformed_size_record_lets_the_job_through(tmp_path: Path, mangle, needle) -> None:  # type: ignore[no-untyped-def]
    text = mangle(snapshot.render(snap(EIGHT)))
    [got] = run_filter(tmp_path, text, [JobRequest(4, True)])
    assert set(got) == {"rc", "logs"}
    assert needle in got["logs"][0]  # type: ignore[index]
