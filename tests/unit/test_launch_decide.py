"""The launcher's decisions, as pure functions of what it saw."""

from __future__ import annotations

import pytest

from gpuwarden.launch import decide
from gpuwarden.launch.decide import Layout, ProgressWatch, RankView
from gpuwarden.launch.settings import EXIT_REQUEUE, LaunchSettings, settings

S = LaunchSettings(beat_s=1, deadline_s=10, start_s=60, hang_s=300)


def views(*lasts: float | None, progress: int = 5, done: tuple[int, ...] = ()) -> list[RankView]:
    return [RankView(r, None if t is None else f"n{r}", t, progress, r in done)
            for r, t in enumerate(lasts)]


def test_the_first_n_nodes_train_and_the_last_k_wait() -> None:
    assert decide.plan(["a", "b", "c", "d"], 1) == Layout(("a", "b", "c"), ("d",))
    with pytest.raises(ValueError, match="N\\+2"):
        decide.plan(["a", "b"], 2)
    with pytest.raises(ValueError, match="twice"):
        decide.plan(["a", "a", "b"], 1)


def test_a_lost_nodes_rank_moves_to_a_spare_and_every_other_rank_stays() -> None:
    lay = Layout(("a", "b", "c"), ("d", "e"))
    got = decide.replace_lost(lay, ["b"])
    assert got == Layout(("a", "d", "c"), ("e",), ("b",))
    # Two losses with k = 2, one after the other; a third finds no spare: requeue.
    assert got is not None
    second = decide.replace_lost(got, ["a"])
    assert second == Layout(("e", "d", "c"), (), ("b", "a"))
    assert second is not None
    assert decide.replace_lost(second, ["c"]) is None


def test_a_spare_on_the_lost_nodes_leaf_switch_is_taken_first() -> None:
    lay = Layout(("a", "b"), ("x", "y"))
    leaf = {"a": "L1", "b": "L2", "x": "L1", "y": "L2"}
    assert decide.replace_lost(lay, ["b"], leaf) == Layout(("a", "y"), ("x",), ("b",))
    assert decide.replace_lost(lay, ["b"], {}) == Layout(("a", "x"), ("y",), ("b",))


def test_more_losses_than_spares_requeue() -> None:
    assert decide.replace_lost(Layout(("a", "b", "c"), ("d",)), ["a", "b"]) is None


def test_slurms_own_placement_is_followed_when_it_differs() -> None:
    lay = Layout(("a", "d", "c"), ())
    assert decide.adopt(lay, ["a", "c", "d"]).ranks == ("a", "c", "d")
    assert decide.adopt(lay, ["a", None, "c"]) == lay  # not everyone reported yet
    assert decide.adopt(lay, ["a", "zz", "c"]) == lay  # not our nodes: keep the plan


def test_a_rank_silent_past_the_deadline_is_lost_the_others_are_not() -> None:
    w = ProgressWatch()
    v = decide.judge(views(100, 90.5, 100), Layout(("n0", "n1", "n2"), ()), 0, 100.6, S, w,
                     None)
    assert v.kind == "lost"
    assert [(x.rank, x.node) for x in v.lost] == [(1, "n1")]
    assert "10.1 s" in v.lost[0].why
    assert decide.judge(views(100, 91, 100), Layout(("n0", "n1", "n2"), ()), 0, 100.5, S, w,
                        None).kind == "running"


def test_a_rank_that_never_beats_is_lost_only_after_the_start_allowance() -> None:
    lay = Layout(("n0", "n1"), ())
    w = ProgressWatch()
    assert decide.judge(views(59, None), lay, 0, 59.9, S, w, None).kind == "running"
    v = decide.judge(views(59, None), lay, 0, 60, S, w, None)
    assert v.kind == "lost" and v.lost[0].node == "n1" and "within 60 s" in v.lost[0].why


def test_every_rank_silent_spends_no_spare() -> None:
    lay = Layout(("n0", "n1"), ("n2",))
    v = decide.judge(views(None, None), lay, 0, 61, S, ProgressWatch(), None)
    assert v.kind == "blind"
    # ... and srun's own exit then decides.
    assert decide.judge(views(None, None), lay, 0, 61, S, ProgressWatch(), 3).code == 3


def test_a_finishing_rank_may_fall_silent() -> None:
    v = decide.judge(views(100, 50, done=(1,)), Layout(("n0", "n1"), ()), 0, 100, S,
                     ProgressWatch(), None)
    assert v.kind == "running"


def test_srun_exit_codes_pass_through_unless_a_node_was_lost() -> None:
    lay, w = Layout(("n0", "n1"), ("n2",)), ProgressWatch()
    assert decide.judge(views(100, 100), lay, 0, 100, S, w, 0) == decide.Verdict("exited", 0)
    assert decide.judge(views(100, 100), lay, 0, 100, S, w, EXIT_REQUEUE).code == EXIT_REQUEUE
    # The training's own failure (every rank alive until srun ended): its status, no spare.
    assert decide.judge(views(100, 100), lay, 0, 100, S, w, 1) == decide.Verdict("exited", 1)
    assert decide.judge(views(100, 80), lay, 0, 100, S, w, 137).kind == "lost"


def test_a_node_srun_reports_failed_is_lost_before_its_deadline() -> None:
    v = decide.judge(views(100, 100), Layout(("n0", "n1"), ("n2",)), 0, 100, S,
                     ProgressWatch(), None, ["n1", "elsewhere"])
    assert v.kind == "lost" and [x.rank for x in v.lost] == [1]


def test_a_hang_is_no_progress_past_hang_s_while_every_rank_beats() -> None:
    lay, w = Layout(("n0", "n1"), ()), ProgressWatch()
    w.begin(0)
    w.see(views(10, 10, progress=-1), 10)
    assert w.value is None  # nothing saved yet: restore has hang_s from every rank beating
    assert decide.judge(views(309, 309, progress=-1), lay, 0, 309, S, w, None).kind == "running"
    w.see(views(20, 20, progress=3), 20)
    w.see(views(30, 30, progress=4), 30)
    assert decide.judge(views(319, 319, progress=4), lay, 0, 319, S, w, None).kind == "running"
    v = decide.judge(views(330, 330, progress=4), lay, 0, 330, S, w, None)
    assert v.kind == "hung" and "300 s" in v.why


def test_a_job_that_saves_rarely_is_not_hung_between_saves() -> None:
    w = ProgressWatch()
    w.begin(0)
    w.see(views(1800, 1800, progress=100), 1800)  # first save after 30 min
    assert not w.hung(views(1, 1, progress=100), 1800 + 3000, 300)
    assert w.hung(views(1, 1, progress=100), 1800 + 3600, 300)
    assert not w.hung(views(1, 1, progress=100), 1800 + 3600, 0)  # 0: off


def test_the_slowest_rank_is_the_jobs_progress() -> None:
    w = ProgressWatch()
    w.begin(0)
    w.see([RankView(0, "a", 1, 7, False), RankView(1, "b", 1, 5, False)], 1)
    assert w.value == 5
    w.see([RankView(0, "a", 2, 9, False), RankView(1, "b", 2, 5, False)], 2)
    assert (w.value, w.at) == (5, 1)


def test_a_hang_relaunches_once_then_requeues() -> None:
    assert decide.after_hang(0, S) and not decide.after_hang(1, S)


def test_settings_refuse_a_deadline_one_lost_datagram_could_trip() -> None:
    with pytest.raises(ValueError, match="--deadline-s: at least 3 x beat_s"):
        settings(beat_s=1, deadline_s=2)
    assert settings(spares=2).spares == 2


def test_a_hang_before_the_first_progress_is_caught_hang_s_after_every_rank_beats() -> None:
    # D6: a hang in init_process_group or the first collective after restore.
    lay, w = Layout(("n0", "n1"), ()), ProgressWatch()
    w.begin(0)
    w.see(views(None, 10, progress=-1), 10)
    w.see(views(15, 15, progress=-1), 15)  # every rank beats from here
    assert decide.judge(views(314, 314, progress=-1), lay, 0, 314, S, w, None).kind == "running"
    v = decide.judge(views(315, 315, progress=-1), lay, 0, 315, S, w, None)
    assert v.kind == "hung" and "300 s" in v.why


def test_nodes_silent_when_another_is_lost_are_lost_with_it() -> None:
    # D2: a rack's power: n1 went quiet 3 s after n2, both dead; n0 beat a moment ago.
    v = decide.judge(views(100, 89.9, 93, 99.5), Layout(("n0", "n1", "n2", "n3"), ("a", "b")),
                     0, 100, S, ProgressWatch(), None)
    assert v.kind == "lost" and [x.rank for x in v.lost] == [1, 2]
    nxt = decide.replace_lost(Layout(("n0", "n1", "n2", "n3"), ("a", "b")),
                              [x.node for x in v.lost])
    assert nxt is not None and nxt.ranks == ("n0", "a", "b", "n3")


def test_a_rank_that_exited_by_itself_is_a_failure_not_a_lost_node() -> None:
    # D4: rank 1 exited 3 (srun printed it: its node is alive) and fell silent.
    lay = Layout(("n0", "n1", "n2"), ("n3",))
    v = decide.judge(views(100, 80, 100), lay, 0, 100, S, ProgressWatch(), None, exits={1: 3})
    assert v.kind == "failed" and v.code == 3 and "rank 1" in v.why
    # srun's own status is the others' SIGTERM (the launcher ended them): the rank's wins.
    v = decide.judge(views(100, 80, 100), lay, 0, 100, S, ProgressWatch(), 143, exits={1: 3})
    assert v == decide.Verdict("exited", code=3)
    # 75 (saved at the time limit) is no failure: the others are saving too.
    v = decide.judge(views(100, 100, 100, done=(0, 1, 2)), lay, 0, 100, S, ProgressWatch(),
                     None, exits={0: 75})
    assert v.kind == "running"
