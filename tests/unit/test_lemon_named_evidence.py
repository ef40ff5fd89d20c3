"""More evidence never hides a lemon: failures events name a node in add to the case against it.

Reproduced on the benchmark (issue 36, part 2; 20x lemons, half of their gang incidents
silent, gang placement, seed 2): a lemon whose events named it in 8 failures (1.4 expected)
was judged on those alone (p 1e-4, doubled) and missed, while the refits of its silent
failures gave p 5e-6. The named test's shortcut ("a node its events convict needs no refit")
fired on a p-value that convicts a node on its own but not across the fleet.
"""

from __future__ import annotations

import math
import random

import pytest

from gpuwarden.lemon.inference import gamma_p
from gpuwarden.lemon.verdict import small_count_factor
from tests.unit.test_lemon_inference import USERS, History
from tests.unit.test_lemon_site_styles import fleet, lemons, line


@pytest.mark.parametrize("named", range(6))
def test_a_lemon_named_by_more_events_is_found_as_surely(named: int) -> None:
    """c5 fails half of its 24 two-node jobs (changing partners, no event names it) and events
    name it in ``named`` one-node failures. Before: found with 0-2 and 4-5, missed with 3
    (p 4e-7 with 2, 3e-3 with 3): the three named failures alone decided it."""
    h = History()
    fleet(h, "own", random.Random(11))
    for _ in range(named):
        h.run("c5", "NODE_FAIL", failed_node="c5", submit=line("own", 1, "x", 0))
    partners = [f"c{i}" for i in range(1, 33) if i != 5]
    rng = random.Random(5)
    for k in range(24):
        user = USERS[k % len(USERS)]
        h.run(f"c5,{rng.choice(partners)}", "FAILED" if k % 2 == 0 else "COMPLETED",
              user=user, submit=line("own", 2, user, k % 4))
    s = h.scores()
    assert lemons(s) == ["c5"], (s["c5"].p_value, s["c5"].q_value, s["c5"].explanation)
    assert s["c5"].q_value <= 0.005


@pytest.mark.parametrize(("k", "mean"), [(4, 0.28), (8, 1.39), (6, 0.91), (1, 0.3), (40, 2.0)])
def test_the_refits_asymptotic_p_is_put_back_to_the_exact_tail_of_a_named_count(
        k: int, mean: float) -> None:
    """On a node whose evidence is only its named failures the refits' likelihood ratio is
    that count's: scaled by the factor it is the exact Poisson tail, never bolder. Unscaled,
    an ordinary node named 4 times (0.3 expected) came out at 8.7e-5 instead of 2.1e-4 and,
    with a little shared gang evidence, was a lemon (held-out seed 11 of the benchmark)."""
    d = 2 * (k * math.log(k / mean) - (k - mean))
    p_lrt = 0.5 * math.erfc(math.sqrt(d / 2))
    factor = small_count_factor(k, mean)
    assert factor >= 1.0
    assert p_lrt * factor == pytest.approx(gamma_p(k, mean), rel=1e-9)
    assert small_count_factor(0, mean) == 1.0 and small_count_factor(1, 2.0) == 1.0
