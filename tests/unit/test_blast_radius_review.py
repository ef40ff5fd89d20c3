"""The blast-radius cap against the review of its rework (issue 11 item 5): failures after the
drain, a tie wait cut short, Slurm appending to our reason, whole-table reads, comments. The
real CliSlurmClient talks to the stand-in slurmctld of tests/ctld.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.core.errors import SlurmError
from gpuwarden.health import gate
from gpuwarden.health.model import CheckResult, Status, Verdict
from gpuwarden.health.store import Counters
from gpuwarden.hooks import entry
from gpuwarden.slurm import drain
from gpuwarden.slurm.client import CliSlurmClient, gpuwarden_reason
from gpuwarden.slurm.drain_cap import BlastRadius
from gpuwarden.slurm.reasons import health_reason, is_health_drain
from gpuwarden.slurm.runner import CommandResult, CommandTimeoutError
from gpuwarden.slurm.settings import SlurmConfig
from tests.ctld import FakeCtld
from tests.unit.test_entry import break_gpu, node_env  # noqa: F401 (a fixture)

NOW = 1_800_000_000.0
CAP = BlastRadius(max_drained_pct=25.0, settle_s=0)  # 4 nodes: one place
WHY = health_reason("xid 79 on GPU 5")
FULL = gpuwarden_reason(WHY)
ECC = gpuwarden_reason(health_reason("ecc"))
DRAIN = drain.Decision(drain.Kind.DRAIN, WHY, 0)
LEMON_WOULD = "gpuwarden: would drain: lemon, 7 of 41 jobs failed (blast-radius cap: ...)"


@pytest.fixture
def env8(request: pytest.FixtureRequest) -> tuple[entry.Env, object, Path]:
    """test_entry's node: c3 of 8, a fake GPU probe, a FakeSlurm client."""
    got: tuple[entry.Env, object, Path] = request.getfixturevalue("node_env")
    return got


class Wrap:
    """A CommandRunner over FakeCtld that lets a test answer some commands itself."""

    def __init__(self, ctld: FakeCtld,
                 answer: Callable[[tuple[str, ...]], CommandResult | None]) -> None:
        self.ctld, self.answer = ctld, answer

    def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        got = self.answer(tuple(argv))
        return got if got is not None else self.ctld.run(argv, timeout)


def client(runner: FakeCtld | Wrap) -> CliSlurmClient:
    return CliSlurmClient(SlurmConfig(retries=0), runner)


def lands_with_ours(ctld: FakeCtld, name: str = "c1") -> None:
    """Another node's health drain lands in the same controller second as ours."""
    fired: list[bool] = []

    def hook(argv: tuple[str, ...]) -> None:
        if not fired and "state=drain" in argv:
            fired.append(True)
            ctld.set(name, state=("IDLE", "DRAIN"), reason=ECC)

    ctld.before = hook


def verdict(status: Status) -> Verdict:
    return Verdict("c3", NOW, "test", (CheckResult("xid", status, "xid 79", 5, "xid 79"),))


# ---- 1. a failure after the drain never leaves it past the cap ----

def test_a_failed_reread_after_the_drain_undoes_the_drain() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    lands_with_ours(ctld)
    reads: list[int] = []

    def second_out_of_service_read_fails(argv: tuple[str, ...]) -> CommandResult | None:
        if any(a.startswith("--states=") for a in argv):
            reads.append(1)
            if len(reads) == 2:
                return CommandResult(argv, 1, "", "Socket timed out on send/recv operation\n")
        return None

    c = client(Wrap(ctld, second_out_of_service_read_fails))
    with pytest.raises(SlurmError, match="not ranked against the blast-radius cap.*undone"):
        drain.apply(DRAIN, c.node("c3"), c, CAP, sleep=lambda s: None)
    assert ctld.drained == ["c1"]


def test_a_drain_whose_update_timed_out_but_was_applied_is_undone() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    lands_with_ours(ctld)

    def applied_then_timed_out(argv: tuple[str, ...]) -> CommandResult | None:
        if "state=drain" in argv:
            ctld.run(argv, 30)
            raise CommandTimeoutError(argv, 30)
        return None

    c = client(Wrap(ctld, applied_then_timed_out))
    with pytest.raises(SlurmError, match="undone"):
        drain.apply(DRAIN, c.node("c3"), c, CAP, sleep=lambda s: None)
    assert ctld.drained == ["c1"]


def test_an_unranked_health_drain_past_the_cap_is_ranked_again_and_undone() -> None:
    """A drain left past the cap (its undo failed, the run was killed) is ranked again at the
    node's next health check while the node's counters do not record it as kept."""
    ctld = FakeCtld.cluster(4, now=NOW)
    ctld.set("c1", state=("IDLE", "DRAIN"), reason=ECC, reason_changed_at=int(NOW) - 5)
    ctld.set("c3", state=("IDLE", "DRAIN"), reason=FULL, reason_changed_at=int(NOW))
    c = client(ctld)
    node = c.node("c3")
    d = gate.decide(verdict(Status.CRITICAL), node, 0, 3, FULL, kept=False)
    assert d.kind is drain.Kind.RERANK
    applied = drain.apply(d, node, c, CAP, sleep=lambda s: None)
    assert applied.action == "held" and "blast-radius cap" in applied.detail
    assert ctld.drained == ["c1"]
    # c1's drain, within the cap, is ranked again and stays.
    n1 = c.node("c1")
    d1 = gate.decide(verdict(Status.CRITICAL), n1, 0, 3, ECC, kept=False)
    assert drain.apply(d1, n1, c, CAP, sleep=lambda s: None).action == "kept"
    assert ctld.drained == ["c1"]


def test_a_drain_recorded_as_kept_is_never_ranked_again() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    ctld.set("c3", state=("IDLE", "DRAIN"), reason=FULL)
    node = client(ctld).node("c3")
    d = gate.decide(verdict(Status.CRITICAL), node, 0, 3, FULL, kept=True)
    assert d.kind is drain.Kind.NOTHING


def test_the_health_check_heals_a_drain_its_earlier_run_left_past_the_cap(  # type: ignore[no-untyped-def]
        env8) -> None:
    env, slurm, tmp = env8
    break_gpu(tmp)
    for name, stamp in (("c1", NOW - 60), ("c2", NOW - 30), ("c3", NOW)):
        slurm.table[name] = replace(slurm.table[name], state=("IDLE", "DRAIN"),
                                    reason=gpuwarden_reason(health_reason("ecc")),
                                    reason_changed_at=int(stamp))
    # 25% of 8 nodes: two places, held by c1 and c2. c3's run was killed before ranking.
    assert entry.periodic(env) == 0
    assert not slurm.table["c3"].drained and slurm.log == ["resume c3"]


# ---- 2. the tie wait is a precondition ----

def test_with_less_time_left_than_the_tie_wait_and_the_calls_no_drain_is_made() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    c = client(ctld)
    applied = drain.apply(DRAIN, c.node("c3"), c, CAP, sleep=lambda s: None, left=lambda: 2.5)
    assert applied.action == "held" and "left in this run" in applied.detail
    assert not [a for a in ctld.calls if "state=drain" in a] and ctld.drained == []


def test_the_tie_wait_is_never_cut_short() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    c = client(ctld)
    slept: list[float] = []
    assert drain.apply(DRAIN, c.node("c3"), c, CAP, sleep=slept.append,
                       left=lambda: 3.5).action == "drained"
    assert slept == [drain.TIE_S]


def test_a_health_check_near_its_deadline_holds_instead_of_draining(  # type: ignore[no-untyped-def]
        env8) -> None:
    env, slurm, tmp = env8
    break_gpu(tmp)
    slept: list[float] = []
    env = replace(env, sleep=slept.append, end=100.0, mono=lambda: 97.5)  # 2.5 s left
    assert entry.periodic(env) == 0
    assert slurm.log == [] and not slurm.table["c3"].drained and slept == []


# ---- 3. slurmctld appends to our reason and re-stamps it ----

@pytest.mark.parametrize("msg", ["Not responding", "reboot issued", "ResumeTimeout reached"])
def test_a_health_drain_slurm_appended_to_is_still_ours_and_resumes(msg: str) -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    ctld.set("c3", state=("IDLE", "DRAIN"), reason=FULL, reason_changed_at=int(NOW) - 600)
    ctld.now += 60
    ctld.slurm_appends("c3", msg, state=("DOWN", "DRAIN"))
    c = client(ctld)
    node = c.node("c3")
    assert node.reason == f"{FULL} : {msg}" and is_health_drain(node.reason)
    own = entry.own_reason(Counters(passes=5, last_status="OK", drained_reason=FULL), node)
    d = gate.decide(verdict(Status.OK), node, 2, 3, own)
    assert d.kind is drain.Kind.RESUME
    assert drain.apply(d, node, c, CAP, sleep=lambda s: None).action == "resumed"
    assert ctld.drained == []


def test_a_reboot_after_slurm_appended_reboot_issued_resumes_at_the_first_pass() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    ctld.set("c3", state=("IDLE", "DRAIN"), reason=FULL, reason_changed_at=int(NOW) - 600)
    ctld.now += 10
    ctld.slurm_appends("c3", "reboot issued")
    node = replace(client(ctld).node("c3"), boot_time=int(NOW) + 100)
    d = gate.decide(verdict(Status.OK), node, 0, 3, FULL)
    assert d.kind is drain.Kind.RESUME and "rebooted" in d.why


def test_a_kept_drain_restamped_by_slurm_never_lets_a_second_drain_past_the_cap() -> None:
    """c1's drain lands in the same controller second as c3's and ranks first (its name); then
    slurmctld marks c1 "Not responding", moving its stamp after c3's: c3 must still yield."""
    ctld = FakeCtld.cluster(4, now=NOW)
    lands_with_ours(ctld)

    def settle(seconds: float) -> None:
        ctld.now += 1
        ctld.slurm_appends("c1", "Not responding", state=("DOWN", "DRAIN"))

    c = client(ctld)
    applied = drain.apply(DRAIN, c.node("c3"), c, CAP, sleep=settle)
    assert applied.action == "held"
    assert ctld.drained == ["c1"]


def test_the_stand_in_controller_restamps_every_update_carrying_a_reason() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    ctld.set("c3", state=("IDLE", "DRAIN"), reason=FULL)
    ctld.now += 5
    ctld.run(["scontrol", "update", "nodename=c3", f"reason={FULL}"], 5)
    assert ctld.table["c3"].reason_changed_at == int(NOW) + 5


def test_our_own_reasons_never_carry_slurms_separator() -> None:
    assert gpuwarden_reason("cable a : b") == "gpuwarden: cable a - b"


# ---- 4. whole-table loads, 5. the resume's window, 6. comments ----

def test_a_drain_within_the_cap_loads_the_whole_node_table_at_most_four_times() -> None:
    ctld = FakeCtld.cluster(64, now=NOW)
    c = client(ctld)
    node = c.node("c3")
    before = ctld.table_loads
    assert drain.apply(DRAIN, node, c, CAP, sleep=lambda s: None).action == "drained"
    # Two reads of the nodes out of service (sinfo + scontrol, each a whole-table load);
    # the drain's own re-read and the comment's take the single-node RPC.
    assert ctld.table_loads - before == 4


def test_the_undo_rereads_with_the_single_node_rpc_right_before_its_update() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    lands_with_ours(ctld)
    c = client(ctld)
    assert drain.apply(DRAIN, c.node("c3"), c, CAP, sleep=lambda s: None).action == "held"
    i = next(i for i, a in enumerate(ctld.calls) if "state=resume" in a)
    assert ctld.calls[i - 1][:4] == ("sinfo", "--all", "-n", "c3")


def test_a_health_drain_keeps_the_lemon_scanners_would_drain_comment() -> None:
    ctld = FakeCtld.cluster(8, now=NOW)
    ctld.set("c3", comment=LEMON_WOULD)
    c = client(ctld)
    assert drain.apply(DRAIN, c.node("c3"), c, CAP, sleep=lambda s: None).action == "drained"
    assert ctld.table["c3"].comment == LEMON_WOULD


def test_a_failure_clearing_the_comment_after_a_kept_drain_is_still_drained() -> None:
    ctld = FakeCtld.cluster(8, now=NOW)
    ctld.set("c3", comment="gpuwarden: would drain: xid 79 on GPU 5 [health] (cap)")

    def comment_fails(argv: tuple[str, ...]) -> CommandResult | None:
        if any(a.startswith("comment=") for a in argv):
            return CommandResult(argv, 1, "", "Socket timed out on send/recv operation\n")
        return None

    c = client(Wrap(ctld, comment_fails))
    assert drain.apply(DRAIN, c.node("c3"), c, CAP, sleep=lambda s: None).action == "drained"
    assert ctld.table["c3"].reason == FULL


def test_node_reads_include_hidden_partitions() -> None:
    ctld = FakeCtld.cluster(4, now=NOW)
    c = client(ctld)
    c.node("c3")
    c.out_of_service(also=("c3",))
    assert all("--all" in a for a in ctld.calls if a[0] == "scontrol")


def test_the_single_node_read_parses_what_sinfo_prints(tmp_path: Path) -> None:
    ctld = FakeCtld.cluster(4, per_partition=2, now=NOW)
    ctld.set("c3", state=("IDLE", "DRAIN"), reason=FULL, comment="rack 7")
    from gpuwarden.slurm import parse

    out = ctld.run(["sinfo", "--all", "-n", "c3", "--json"], 5).stdout
    node = parse.parse_sinfo_node(out, "c3")
    assert node is not None and node.reason == FULL and node.drained
    assert node.reason_changed_at == int(NOW) and node.comment == "rack 7"
    assert node.partitions == ("p1",)
