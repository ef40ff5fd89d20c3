"""Issue 13 items 1-3, reproduced by the red team (one user framing a node; healthy gang-block
nodes flagged with no attacker; getopt forms that hid a -w pin)."""

from __future__ import annotations

import random

import pytest

from gpuwarden.accounting.attribution import attribute, node_failures
from gpuwarden.accounting.submit import ALL_NODES, named_nodes, script_key
from gpuwarden.lemon.scoring import NodeScore, score
from tests.unit.test_lemon_inference import USERS, History


def _fleet(h: History, rng: random.Random, days: int = 30, nodes: int = 32) -> None:
    """Healthy identical nodes: one-node jobs, aligned pairs, aligned 8-node gang blocks whose
    jobs fail silently 10% of the time (the blocks' nodes always run together)."""
    for _ in range(days):
        for i in range(1, nodes + 1):
            h.run(f"c{i}", "NODE_FAIL" if rng.random() < 0.005 else "COMPLETED",
                  failed_node=f"c{i}")
        for i in range(1, nodes + 1, 2):
            h.run(f"c[{i}-{i + 1}]", "FAILED" if rng.random() < 0.02 else "COMPLETED",
                  user=rng.choice(USERS), submit=f"sbatch -N2 pair{rng.randrange(5)}.sbatch")
        for i in range(1, nodes + 1, 8):
            for _ in range(8):
                h.run(f"c[{i}-{i + 7}]", "FAILED" if rng.random() < 0.1 else "COMPLETED",
                      user=rng.choice(USERS), submit=f"sbatch -N8 big{rng.randrange(5)}.sbatch")


def _scores(h: History) -> dict[str, NodeScore]:
    return {s.node: s for s in score(attribute(h.jobs, failures=node_failures([])))}


@pytest.mark.parametrize("framing_jobs", [6, 8, 10])
def test_one_user_cannot_frame_a_healthy_gang_node_with_unpinned_failing_jobs(
        framing_jobs: int) -> None:
    """Reproduced: mallory's 6 failing 2-node jobs raised c5's fitted rate, the fit then gave
    c5 its block's ordinary failures, so her share looked small and c5 was flagged (q 5e-4)."""
    h = History()
    _fleet(h, random.Random(1))
    rng = random.Random(99)
    for _ in range(framing_jobs):
        x = rng.choice([i for i in range(1, 33) if i != 5])
        h.run(",".join(f"c{i}" for i in sorted([5, x])), "FAILED", hours=0.01, user="mallory",
              submit="sbatch -N2 --wrap exit 1")
    s = _scores(h)
    assert [n for n, x in s.items() if x.lemon] == [], {n: x.q_value for n, x in s.items()
                                                         if x.lemon}
    assert s["c5"].q_value > 0.01


@pytest.mark.parametrize("seed", [6, 7])
def test_a_gang_node_with_an_ordinary_node_fail_is_not_handed_its_blocks_failures(
        seed: int) -> None:
    """Reproduced with no attacker: one or two ordinary NODE_FAILs broke the tie between the
    nodes of a block, the fit put the block's silent failures on that node, and the
    conditional test called it a lemon (q 6e-5); its block-mates cannot be told apart."""
    h = History()
    _fleet(h, random.Random(seed))
    s = _scores(h)
    assert [n for n, x in s.items() if x.lemon] == []


@pytest.mark.parametrize(("line", "nodes", "script"), [
    ("sbatch -N2 --nodel=c5,c9 --wrap exit 1", {"c5", "c9"}, "wrap:exit 1"),
    ("sbatch -N2 --nodeli c5,c9 --wrap exit 1", {"c5", "c9"}, "wrap:exit 1"),
    ("sbatch -N2 -vw c5,c9 --wrap exit 1", {"c5", "c9"}, "wrap:exit 1"),
    ("sbatch -vwc5,c9 -N2 --wrap exit 1", {"c5", "c9"}, "wrap:exit 1"),
    ("sbatch -N2 -Qw c5,c9 job.sh", {"c5", "c9"}, "job.sh"),
    ("sbatch -N2 --nodef=hosts job.sh", ALL_NODES, "job.sh"),
    ("sbatch -N2 -vF hosts job.sh", ALL_NODES, "job.sh"),
    ("sbatch -N2 --wrap echo -w c7 ; exit 1", set(), "wrap:echo -w c7 ; exit 1"),
    ("sbatch -N2 -J -w c7 job.sh", set(), "c7"),
    ("sbatch -N2 --comment -w job.sh", set(), "job.sh"),
    ("sbatch -N2 --comment=x -w c5 job.sh", {"c5"}, "job.sh"),
    ("sbatch -N2 job.sh -w c5", set(), "job.sh"),
    ("srun -N2 -w c5,c9 ./a.out", {"c5", "c9"}, "./a.out"),
])
def test_pins_are_read_as_sbatchs_getopt_reads_them(line: str, nodes: set[str],
                                                    script: str) -> None:
    assert named_nodes(line) == frozenset(nodes)
    assert script_key(line) == script


def test_a_node_with_no_case_against_it_is_not_said_to_have_a_source_left_out() -> None:
    h = History()
    _fleet(h, random.Random(1))
    s = _scores(h)
    assert all("left out (one source" not in x.explanation for x in s.values() if x.q_value > 0.5)
