"""The launcher's note of lost nodes: what it writes is what the epilog reads back."""

from __future__ import annotations

from gpuwarden.slurm import lostnote


def test_written_and_read_back() -> None:
    text = lostnote.format_lost([("c3", 1, "no heartbeat for 6.0 s"),
                                 ("gpu-a.7", 0, "srun: node failure")])
    assert lostnote.lost_in(text) == {"c3": "rank 1: no heartbeat for 6.0 s",
                                      "gpu-a.7": "rank 0: srun: node failure"}


def test_a_cut_note_still_names_the_newest_losses() -> None:
    many = [(f"node{i:03d}", i, "no heartbeat for 6.0 s after the last progress") for i in range(9)]
    text = lostnote.format_lost(many)
    assert len(text) <= lostnote.MAX_LEN and text.startswith(lostnote.PREFIX + "...; ")
    assert "node008" in lostnote.lost_in(text) and "node000" not in lostnote.lost_in(text)


def test_anything_else_names_no_node() -> None:
    for other in (None, "", "(null)", "my own comment c3 (rank 1: x)",
                  "gpuwarden: this job may wait", "gpuwarden-launch: lost ../etc (rank 1: x)",
                  "gpuwarden-launch: lost c3 rank 1"):
        assert lostnote.lost_in(other) == {}, other


def test_only_empty_or_gpuwardens_own_comments_are_replaced() -> None:
    assert lostnote.replaceable(None) and lostnote.replaceable("(null)")
    assert lostnote.replaceable("gpuwarden: this job may wait up to 60 s for one leaf")
    assert not lostnote.replaceable("experiment 12, lr sweep")


def test_what_the_owner_wrote_reaches_roots_logs_printable_and_short() -> None:
    got = lostnote.lost_in(lostnote.PREFIX + "c3 (rank 1: \x1b[2Jfake\nline " + "x" * 500 + ")")
    assert got["c3"].startswith("rank 1: ?[2Jfake?line") and len(got["c3"]) <= 120
