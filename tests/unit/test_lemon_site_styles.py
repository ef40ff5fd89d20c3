"""Issue 36 part 2: lemons on a site where every job is `sbatch train.sh`.

A script is named by what `submit_line` shows, so there the "source" train.sh is the whole
fleet. Leaving it out of a node's test (as one source holding half of the node's excess)
left out every lemon's silent failures. A source is now left out only for what it holds
beyond its share of the fleet's runs; the decoys (a framer, a broken partition, a busy node)
must stay unflagged on both kinds of site, and on the train.sh site a framer is still a
source of her own (a user), whatever her script is called.
"""

from __future__ import annotations

import random

import pytest

from gpuwarden.lemon.scoring import NodeScore
from tests.unit.test_lemon_inference import USERS, History

STYLES = ("own", "train.sh")
PARTITION = ("c29", "c30", "c31", "c32")


def line(style: str, n: int, user: str, k: int) -> str:
    """The submit line of a job of ``n`` nodes: everyone's `train.sh`, or a user's own."""
    return f"sbatch -N{n} train.sh" if style == "train.sh" else f"sbatch -N{n} {user}/train{k}.sbatch"


def fleet(h: History, style: str, rng: random.Random, busy: str = "") -> None:
    """An ordinary fleet c1..c32 for 30 days: one-node jobs (rare NODE_FAILs), aligned pairs
    and fours failing silently now and then; ``busy`` takes three times a node's runs."""
    for _ in range(30):
        for i in range(1, 33):
            for _ in range(3 if f"c{i}" == busy else 1):
                h.run(f"c{i}", "NODE_FAIL" if rng.random() < 0.01 else "COMPLETED",
                      failed_node=f"c{i}", submit=line(style, 1, "x", 0))
        for n, p in ((2, 0.02), (4, 0.03)):
            for i in range(1, 33, n):
                block = f"c[{i}-{i + n - 1}]"
                for _ in range(3 if busy and f"c{i}" <= busy <= f"c{i + n - 1}" else 1):
                    user = rng.choice(USERS)
                    h.run(block, "FAILED" if rng.random() < p else "COMPLETED", user=user,
                          submit=line(style, n, user, rng.randrange(4)))


def lemons(s: dict[str, NodeScore]) -> list[str]:
    return sorted(n for n, x in s.items() if x.lemon)


@pytest.mark.parametrize("style", STYLES)
def test_a_lemon_whose_silent_failures_are_the_fleets_common_script_is_found(style: str) -> None:
    """Reproduced: on the train.sh site, c5's twelve silent gang failures (five users, changing
    partners) all came from "script train.sh", which held them all and was left out as one
    source: c5 kept one named failure and was missed (q 1.0). On the other site, found."""
    h = History()
    fleet(h, style, random.Random(11))
    h.run("c5", "NODE_FAIL", failed_node="c5", submit=line(style, 1, "x", 0))
    partners = [f"c{i}" for i in range(1, 33) if i != 5]
    rng = random.Random(5)
    for k in range(24):
        user = USERS[k % len(USERS)]
        h.run(f"c5,{rng.choice(partners)}", "FAILED" if k % 2 == 0 else "COMPLETED",
              user=user, submit=line(style, 2, user, k % 4))
    s = h.scores()
    assert lemons(s) == ["c5"], (s["c5"].q_value, s["c5"].explanation)
    assert "of script train.sh left out" not in s["c5"].explanation


@pytest.mark.parametrize("style", STYLES)
def test_a_user_framing_a_node_with_40_failing_jobs_makes_no_lemon(style: str) -> None:
    """The shared name is no hiding place: mallory's `sbatch -N2 train.sh` jobs (their
    `#SBATCH -w c5` lines are inside the script, which accounting does not show) are one
    user's, beyond her share of the fleet's runs."""
    h = History()
    fleet(h, style, random.Random(12))
    rng = random.Random(40)
    for _ in range(40):
        x = f"c{rng.choice([i for i in range(1, 33) if i != 5])}"
        h.run(",".join(sorted(["c5", x])), "FAILED", hours=0.01, user="mallory",
              submit=line(style, 2, "mallory", 0))
    s = h.scores()
    assert lemons(s) == [], {n: s[n].explanation for n in lemons(s)}
    assert s["c5"].q_value > 0.01
    assert "of user mallory left out" in s["c5"].explanation


@pytest.mark.parametrize("style", STYLES)
def test_one_users_broken_script_on_a_small_partition_makes_no_lemon(style: str) -> None:
    h = History()
    fleet(h, style, random.Random(13))
    rng = random.Random(3)
    for _ in range(60):
        pair = sorted(rng.sample(PARTITION, 2))
        h.run(",".join(pair), "FAILED", hours=0.5, user="oscar",
              submit="sbatch -p small -N2 " + ("train.sh" if style == "train.sh"
                                               else "broken.sbatch"))
    s = h.scores()
    assert lemons(s) == [], {n: s[n].explanation for n in lemons(s)}


@pytest.mark.parametrize("style", STYLES)
def test_a_busy_node_is_no_lemon(style: str) -> None:
    """c9 runs three times as many one-node jobs as any other node, and its pair and four
    three times as many gang jobs, at the fleet's rates: more failures, not more per hour."""
    h = History()
    fleet(h, style, random.Random(14), busy="c9")
    s = h.scores()
    assert s["c9"].hours > 1.5 * s["c1"].hours
    assert lemons(s) == [], {n: s[n].explanation for n in lemons(s)}


def test_every_runs_node_hours_go_to_its_user_and_script() -> None:
    """The shares sources are measured against: node-hours by user and script, of every run
    (the plain ones tallied by node list, and the failed ones judged one by one)."""
    from gpuwarden.accounting.attribution import attribute, attribute_runs, node_failures

    h = History()
    h.run("c[1-2]", hours=2.0, user="ann", submit="sbatch -N2 train.sh")
    h.run("c3", hours=1.0, user="ben", submit="sbatch a.sh")
    h.run("c[1-4]", "FAILED", hours=0.5, user="ann", submit="sbatch -N4 a.sh")
    inc = attribute(h.jobs, failures=node_failures([])).incidence.freeze({})
    users = dict(zip(inc.users, inc.user_hours.tolist(), strict=True))
    scripts = dict(zip(inc.scripts, inc.script_hours.tolist(), strict=True))
    assert users == pytest.approx({"ann": 6.0, "ben": 1.0})
    assert scripts == pytest.approx({"train.sh": 4.0, "a.sh": 3.0})
    shares = dict(zip(inc.scripts, inc.script_share().tolist(), strict=True))
    assert shares == pytest.approx({"train.sh": 4 / 7, "a.sh": 3 / 7})
    # Judging every record on its own (the reference the grouped path is held to) agrees.
    one = attribute_runs(h.jobs, {}, grouped=False).incidence.freeze({})
    assert dict(zip(one.users, one.user_hours.tolist(), strict=True)) == pytest.approx(users)
    assert dict(zip(one.scripts, one.script_hours.tolist(), strict=True)) == \
        pytest.approx(scripts)
