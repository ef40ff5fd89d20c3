"""Issue 18 through Slurm: hot spares inside the allocation (ckpt/train_spares.sbatch).

A 3-rank job with one spare (`sbatch -N4`, `gpuwarden launch --spares 1`) loses a training
node (`docker kill`). The launcher hears its rank fall silent, ends the step and relaunches it
on the two survivors plus the spare; every rank restores the newest step all of them hold (the
spare's rank from its partner's replica), and the job ends bit-identical to an uninterrupted
run, with no requeue. The recovery time (kill to every rank training again) is printed.
"""

from __future__ import annotations

import json
import re
import shlex
import time
import uuid
from dataclasses import dataclass
from datetime import datetime

import pytest

from devcluster.harness import JOBS_DIR, Harness
from tests.e2e.test_ckpt_requeue import hostnames, output
from tests.e2e.test_foundation import wait_for
from tests.e2e.test_health import nodes

pytestmark = pytest.mark.timeout(600)

SPARES_SBATCH = "/opt/gpuwarden/ckpt/train_spares.sbatch"


def events(h: Harness, path: str) -> list[dict[str, object]]:
    text = h.exec("slurmctld", ["cat", path]).out
    return [json.loads(line) for line in text.splitlines() if line.strip()]


@dataclass(frozen=True)
class Started:
    job: int
    log: str  # the launcher's events (JSON lines)
    expected: list[str]  # per-rank checksums of an uninterrupted run
    allocated: list[str]  # the job's nodes in rank order, spares last


def start(h: Harness, steps: int, spares: int) -> Started:
    """A 3-rank training with ``spares`` spares, once its step 10 is durable."""
    args = ["--steps", str(steps), "--every", "5", "--mb", "8"]
    expected = h.train_reference(3, args)
    log = f"{JOBS_DIR}/launch-{uuid.uuid4().hex[:8]}.jsonl"
    job = h.sbatch(f"-N{3 + spares}", "--gpus-per-node=8", name="train",
                   script=[SPARES_SBATCH, *args],
                   env={"SPARES": str(spares), "LAUNCH_OPTS": f"--deadline-s 5 --events {log}"})
    wait_for(lambda: max(h.shared_steps(job, 2), default=0) >= 10, 180,
             "step 10 durable on the shared filesystem")
    return Started(job, log, expected, hostnames(h, h.job_fields(job)["NodeList"]))


def forge(h: Harness, node: str, text: str) -> None:
    """``text`` on the stderr of the rank on ``node``, as if it had logged it: as the job's
    user (root in a container may not open another user's descriptors), into the rank's own
    (its command line starts with the interpreter, not the launcher's `-m` nor srun)."""
    res = h.sh(node, "for p in $(pgrep -u alice -f '^[^ ]+ -I [^ ]*[t]rain_example[.]py'); do "
                     f"printf %s {shlex.quote(text)} > /proc/$p/fd/2 && echo $p; done",
               user="alice")
    assert len(res.check("write on the rank's stderr").out.split()) == 1, res.out


def test_a_lost_node_is_replaced_by_a_spare_without_a_requeue(cluster: Harness) -> None:
    h = cluster
    run = start(h, 90, 1)
    job, log, expected, allocated = run.job, run.log, run.expected, run.allocated
    started = events(h, log)
    launch = next(e for e in started if e["event"] == "launch")
    assert launch["spares"] == allocated[3:], launch
    # Issue 33: what a rank logs (a dataset's record: anyone's text) is not srun's word. Rank
    # 0, every rank beating, "reports" rank 2's node failed, its own exit and a 4-billion task
    # range; none of it may spend the spare, end the job or stop the launcher reading.
    other = allocated[2]
    forged = (f"WARNING dataloader: bad sample name: srun: error: Node failure on {other}\n"
              f"reading shard: srun: error: {other}: task 2: Exited with exit code 3\n"
              "bad record: srun: error: x: tasks 0-4000000000: Exited with exit code 1\n"
              f"bad sample name: x\nsrun: error: Node failure on {other}\n")
    forge(h, allocated[0], forged)

    def passed_on() -> bool:
        text = output(h, job)
        return all(line in text for line in forged.splitlines())
    wait_for(passed_on, 60, "the rank's lines in the job's output, as it wrote them")
    # Not the first node: the batch script (and the launcher) runs there, and losing it is
    # the requeue path's case.
    victim = allocated[1]
    killed = time.time()
    h.kill(victim)
    try:
        h.wait_job(job, timeout=400)
    finally:
        h.heal(victim)
    assert h.job_fields(job).get("Restarts", "0") == "0", "no requeue"
    assert h.train_finals(job, 3) == expected, "bit-identical to an uninterrupted run"
    seen = events(h, log)
    lost = [e for e in seen if e["event"] == "lost"]
    assert [[x["node"] for x in e["lost"]] for e in lost] == [[victim]], seen  # type: ignore[union-attr]
    assert other not in h.job_fields(job).get("Comment", ""), "a healthy node reported"
    relaunched = [e for e in seen if e["event"] == "step_started" and e.get("gen") == 2]
    assert relaunched and victim not in relaunched[0]["nodes"], seen  # type: ignore[operator]
    assert allocated[3] in relaunched[0]["nodes"], seen  # type: ignore[operator]
    again = next(e for e in seen if e["event"] == "training" and e.get("gen") == 2)
    text = output(h, job)
    restored = re.findall(r"rank (\d): restored step (\d+) from (\w+)", text)
    assert len({step for _, step, _ in restored}) == 1 and len(restored) >= 3, text[-2000:]
    # Memory speed, not the shared filesystem: the survivors from their own node memory, the
    # lost rank (now on the spare) from the replica its partner holds in memory.
    tiers = {int(r): tier for r, _, tier in restored}
    lost_rank = allocated.index(victim)
    assert tiers[lost_rank] == "peer", tiers
    assert all(t == "memory" for r, t in tiers.items() if r != lost_rank), tiers
    print(f"spare path: lost detected {float(lost[0]['t']) - killed:.1f} s after the kill, "
          f"every rank training again after {float(again['t']) - killed:.1f} s; restored "
          f"from {sorted({tier for _, _, tier in restored})}")
    wait_for(lambda: not nodes(h)[victim].down, 120, f"{victim} back in service")


def test_two_nodes_lost_one_after_the_other_use_both_spares(cluster: Harness) -> None:
    """k = 2: a second node lost after the first relaunch takes the second spare."""
    h = cluster
    run = start(h, 120, 2)
    job, log, expected, allocated = run.job, run.log, run.expected, run.allocated
    victims = [allocated[1], allocated[2]]
    h.kill(victims[0])
    try:
        wait_for(lambda: any(e["event"] == "training" and e.get("gen") == 2
                             for e in events(h, log)), 180, "the first relaunch training")
        step = max(h.shared_steps(job, 2), default=0)
        wait_for(lambda: max(h.shared_steps(job, 2), default=0) >= step + 10, 180,
                 "ten more steps durable after the first relaunch")
        h.kill(victims[1])
        h.wait_job(job, timeout=400)
    finally:
        for v in victims:
            h.heal(v)
    assert h.job_fields(job).get("Restarts", "0") == "0", "no requeue"
    assert h.train_finals(job, 3) == expected, "bit-identical to an uninterrupted run"
    starts = [e for e in events(h, log) if e["event"] == "step_started"]
    assert [e["gen"] for e in starts] == [1, 2, 3], starts
    assert not set(victims) & set(starts[-1]["nodes"]), starts  # type: ignore[arg-type]
    assert set(allocated[3:]) <= set(starts[-1]["nodes"]), starts  # type: ignore[arg-type]
    for v in victims:
        wait_for(lambda v=v: not nodes(h)[v].down, 120, f"{v} back in service")


def test_a_hung_rank_is_replaced_and_its_node_gets_every_check_after_the_job(
        cluster: Harness) -> None:
    """A rank frozen (SIGSTOP: alive, silent) on a node whose GPU then fails: the spare takes
    over, and after the job health gating's epilog reads the launcher's note, runs every check
    on that node and drains it on the checks' own evidence. The note alone drains nothing (see
    tests/unit/test_entry.py): the user writes it."""
    h = cluster
    run = start(h, 90, 1)
    job, log, expected, allocated = run.job, run.log, run.expected, run.allocated
    victim = allocated[2]
    try:
        # "[t]rain": pkill -f must not match (and stop) the `timeout` wrapping it, whose
        # command line holds the pattern.
        h.exec(victim, ["pkill", "-STOP", "-f", "[t]rain_example.py"]).check("freeze the rank")
        wait_for(lambda: any(e["event"] == "lost" for e in events(h, log)), 60,
                 "the launcher to find the frozen rank lost")
        # The GPU fails while the node idles in the allocation: nothing else looks at it
        # until the periodic check, unless the epilog takes the launcher's note.
        h.set_gpu(victim, 3, ecc_uncorrected_volatile=2)
        h.wait_job(job, timeout=400)
        assert h.job_fields(job).get("Restarts", "0") == "0", "no requeue"
        assert h.train_finals(job, 3) == expected, "bit-identical to an uninterrupted run"
        assert victim in h.job_fields(job).get("Comment", ""), "the launcher's note"
        wait_for(lambda: nodes(h)[victim].drained, 60, f"{victim} drained after the job")
        assert nodes(h)[victim].reason in (
            f"gpuwarden: {hook}: 2 uncorrectable ECC errors on GPU 3 [health]"
            for hook in ("epilog", "periodic"))
        # Why the epilog looked is in the verdict it stored, unless the periodic check (its
        # own timer) ran after it and stored a newer one: then that one is from after the job.
        ended = datetime.fromisoformat(h.job_fields(job)["EndTime"]).timestamp()
        seen: set[str] = set()

        def epilog_took_the_note() -> bool:
            res = h.gpuwarden(victim, "health", "show", "--json")
            if res.rc not in (0, 1, 2):
                return False
            shown = json.loads(res.out)
            line = (f"{victim}'s stored verdict: {shown['context']} at {shown['at']:.1f} "
                    f"(the job ended at {ended:.0f})")
            if line not in seen:
                seen.add(line)
                print(line)
            return f"epilog job {job} (its launcher lost this node: rank " in \
                shown["context"] or (shown["context"] == "health check" and
                                     float(shown["at"]) >= ended)
        wait_for(epilog_took_the_note, 60, "the epilog's verdict, taken for the launcher's note")
        for other in allocated:
            if other != victim:
                assert not nodes(h)[other].drained, f"{other} drained too"
    finally:
        h.clear_gpu_faults(victim)
        h.sh(victim, "rm -f /var/lib/gpuwarden/*.json").check("forget the verdict")
        if nodes(h)[victim].drained:
            h.exec("slurmctld", ["scontrol", "update", f"nodename={victim}", "state=resume"])
