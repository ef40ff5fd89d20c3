"""More evidence never hides a lemon: failures events name a node in add to the case against it.

Reproduced on the benchmark (issue 36, part 2; 20x lemons, half of their gang incidents
silent, gang placement, seed 2): a lemon whose events named it in 8 failures (1.4 expected)
was judged on those alone (p 1e-4, doubled) and missed, while the refits of its silent
failures gave p 5e-6. The named test's shortcut ("a node its events convict needs no refit")
fired on a p-value that convicts a node on its own but not across the fleet.
"""

from __future__ import annotations

import random

import pytest

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
