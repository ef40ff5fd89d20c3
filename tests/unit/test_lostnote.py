"""The launcher's note of lost nodes: what it writes is what the epilog reads back."""

from __future__ import annotations

from gpuwarden.slurm import lostnote


def test_written_and_read_back() -> None:
    text = lostnote.format_lost([("c3", 1, "no heartbeat for 6.0 s (deadline 5 s)"),
                                 ("gpu-a.7", 0, "srun: node failure; step 12.0 ended")])
    assert lostnote.lost_in(text) == {"c3": "rank 1: no heartbeat for 6.0 s [deadline 5 s]",
                                      "gpu-a.7": "rank 0: srun: node failure, step 12.0 ended"}


def test_a_whole_leaf_lost_at_once_is_named_node_by_node() -> None:
    """Eight nodes of a leaf switch lost together: every one is named, so every one gets the
    epilog's checks; the older ones lose their why first."""
    leaf = [(f"gpu-node-{i:03d}", i, "no heartbeat for 6.0 s after the last progress, "
             "deadline 5 s, srun says nothing") for i in range(30)]
    text = lostnote.format_lost(leaf)
    assert len(text) <= lostnote.MAX_LEN
    got = lostnote.lost_in(text)
    assert set(got) == {n for n, _, _ in leaf}
    assert got["gpu-node-029"].startswith("rank 29: no heartbeat")
    assert got["gpu-node-000"] == "rank 0"


def test_past_the_limit_the_oldest_go_and_the_note_says_so() -> None:
    many = [(f"node{i:05d}", i, "x") for i in range(200)]
    text = lostnote.format_lost(many)
    assert len(text) <= lostnote.MAX_LEN and text.startswith(lostnote.PREFIX + "...; ")
    got = lostnote.lost_in(text)
    assert "node00199" in got and "node00000" not in got


def test_anything_else_names_no_node() -> None:
    for other in (None, "", "(null)", "my own comment c3 (rank 1: x)",
                  "gpuwarden: this job may wait", "gpuwarden-launch: lost ../etc (rank 1: x)",
                  "gpuwarden-launch: lost c3 rank 1",
                  "gpuwarden-launch: lost c3 (rank 1: x)garbage; c5 (rank 2)",
                  "gpuwarden-launch: lost c3 (rank \u0663)",
                  "gpuwarden-launch: lost c3 (rank 1); ; c5 (rank 2)",
                  "gpuwarden-launch: lost c3 (rank 1: a (b) c)",
                  "gpuwarden-launch: lost " + "c3 (rank 1); " * 500 + "c4 (rank 2)"):
        assert lostnote.lost_in(other) == {}, other


def test_only_empty_or_gpuwardens_own_comments_are_replaced() -> None:
    assert lostnote.replaceable(None) and lostnote.replaceable("(null)")
    assert lostnote.replaceable("gpuwarden: this job may wait up to 60 s for one leaf")
    assert not lostnote.replaceable("experiment 12, lr sweep")


def test_what_the_owner_wrote_reaches_roots_logs_printable_and_short() -> None:
    got = lostnote.lost_in(lostnote.PREFIX + "c3 (rank 1: \x1b[2Jfake\u202eline)")
    assert got == {"c3": "rank 1: ?[2Jfake?line"}
    assert lostnote.lost_in(lostnote.PREFIX + "c3 (rank 1: " + "x" * 101 + ")") == {}
