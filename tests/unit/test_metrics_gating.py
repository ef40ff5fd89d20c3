"""Issue 38: health gating's own series (gpuwarden_gating.prom) after the events that change
them, read back with Prometheus's parser; counts kept across runs, never a hook failed or hung
by them."""

from __future__ import annotations

import json
import logging
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gpuwarden.core import counterfile, metrics
from gpuwarden.health import gatingmetrics
from gpuwarden.health.probe import FakeGpuProbe
from gpuwarden.hooks import entry
from gpuwarden.slurm import reasons
from gpuwarden.slurm.drain import Applied
from tests.promtext import parse, value
from tests.unit.test_entry import break_gpu, node_env  # noqa: F401 - the fixture below uses it
from tests.unit.test_never_silently_off import hook, self_prom

GATING = "gpuwarden_gating.prom"


@pytest.fixture
def node(node_env, tmp_path: Path):  # type: ignore[no-untyped-def]  # noqa: F811
    """test_entry's node c3 (8 nodes, cap 25%: 2), with a textfile directory."""
    env, slurm, tmp = node_env
    env = replace(env, config=replace(env.config, health=replace(
        env.config.health, prom_dir=str(tmp / "prom"))))
    return env, slurm, tmp


def fresh(env: entry.Env) -> entry.Env:
    """The next hook run: a new process, only the state directory carried over."""
    return replace(env, problems={}, gating_changed=False,
                   probe=FakeGpuProbe(env.config.health.fake_gpu_file))


def gating(tmp: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return parse(tmp / "prom" / GATING)[0]


def series(tmp: Path, name: str, **labels: str) -> float | None:
    return value(tmp / "prom" / GATING, name, node="c3", **labels)


def drains(tmp: Path) -> dict[str, float | None]:
    return {h: series(tmp, "gpuwarden_health_drains_total", hook=h) for h in reasons.ORIGINS}


def test_every_periodic_run_writes_the_file_with_the_catalogue_s_types(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    assert entry.periodic(env) == 0 and slurm.log == []
    values, kinds = parse(tmp / "prom" / GATING)
    assert {n: k for n, k in kinds.items()} == {
        "gpuwarden_health_gating_enabled": "gauge",
        "gpuwarden_health_drains_total": "counter",
        "gpuwarden_health_resumes_total": "counter",
        "gpuwarden_health_drains_held_total": "counter",
        "gpuwarden_health_drain_held": "gauge"}
    assert series(tmp, "gpuwarden_health_gating_enabled") == 1
    assert drains(tmp) == {"prolog": 0, "epilog": 0, "periodic": 0}
    assert series(tmp, "gpuwarden_health_drain_held") == 0
    assert len(values) == 7  # node c3 only, each hook once
    mode = (tmp / "prom" / GATING).stat().st_mode
    assert stat.S_IMODE(mode) == 0o644


def test_a_drain_a_cap_refusal_and_a_resume_each_count_once_and_persist(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    # The prolog drains a bad GPU: counted under its hook.
    break_gpu(tmp)
    assert entry.prolog(fresh(env)) == 1
    assert drains(tmp) == {"prolog": 1, "epilog": 0, "periodic": 0}
    assert series(tmp, "gpuwarden_health_drain_held") == 0
    # Fixed; two passing checks in a row resume the node's own drain.
    (tmp / "gpus.json").write_text((tmp / "gpus.json").read_text().replace(
        '"ecc_uncorrected_volatile": 1', '"ecc_uncorrected_volatile": 0'))
    entry.periodic(fresh(env))
    entry.periodic(fresh(env))
    assert slurm.log[-1] == "resume c3"
    assert series(tmp, "gpuwarden_health_resumes_total") == 1
    # Two other nodes drained by gpuwarden fill the cap (25% of 8): the next fault is held.
    for name in ("c1", "c2"):
        slurm.drain(name, "earlier")
    break_gpu(tmp)
    assert entry.periodic(fresh(env)) == 0
    assert slurm.table["c3"].comment.startswith("gpuwarden: would drain")
    assert series(tmp, "gpuwarden_health_drains_held_total") == 1
    assert series(tmp, "gpuwarden_health_drain_held") == 1  # a fault waits at the cap
    assert entry.prolog(fresh(env)) == 0  # held again: the job runs, the refusal counts
    assert series(tmp, "gpuwarden_health_drains_held_total") == 2
    # The cap frees up: the periodic check drains; nothing waits any more.
    slurm.resume("c1")
    entry.periodic(fresh(env))
    assert slurm.table["c3"].drained
    assert drains(tmp) == {"prolog": 1, "epilog": 0, "periodic": 1}
    assert series(tmp, "gpuwarden_health_drain_held") == 0
    assert series(tmp, "gpuwarden_health_resumes_total") == 1
    # The counts are the state directory's, root's alone: a run after a reboot (no process
    # memory, no textfile left) writes them as they were.
    (tmp / "prom" / GATING).unlink()
    entry.periodic(fresh(env))
    assert drains(tmp) == {"prolog": 1, "epilog": 0, "periodic": 1}
    assert series(tmp, "gpuwarden_health_drains_held_total") == 2
    counts = tmp / "state" / gatingmetrics.COUNTS
    assert stat.S_IMODE(counts.stat().st_mode) == 0o600


def test_the_epilog_s_drain_counts_under_its_hook(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    break_gpu(tmp)
    failed = replace(fresh(env), environ={**env.environ, "SLURM_JOB_EXIT_CODE": "256"})
    assert entry.epilog(failed) == 0 and slurm.log == ["drain c3"]
    assert drains(tmp) == {"prolog": 0, "epilog": 1, "periodic": 0}


def test_drain_false_is_gating_off_and_counts_no_drain(node) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    off = replace(env, config=replace(env.config, health=replace(env.config.health, drain=False)))
    break_gpu(tmp)
    assert entry.periodic(fresh(off)) == 0 and slurm.log == []
    assert series(tmp, "gpuwarden_health_gating_enabled") == 0
    assert drains(tmp) == {"prolog": 0, "epilog": 0, "periodic": 0}
    # Not the cap's hold: no fault is said to wait at the cap, no refusal counted.
    assert series(tmp, "gpuwarden_health_drains_held_total") == 0
    assert series(tmp, "gpuwarden_health_drain_held") == 0


def test_a_self_error_turns_gating_off_in_the_file(node) -> None:  # type: ignore[no-untyped-def]
    env, _, tmp = node
    broken = replace(env, config=replace(env.config, health=replace(
        env.config.health, kernel_log=str(tmp / "absent"))))
    entry.periodic(fresh(broken))
    assert series(tmp, "gpuwarden_health_gating_enabled") == 0
    entry.periodic(fresh(env))
    assert series(tmp, "gpuwarden_health_gating_enabled") == 1


def test_a_corrupt_count_file_is_reset_loudly_and_never_stops_the_drain(node, caplog) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    entry.periodic(fresh(env))
    (tmp / "state" / gatingmetrics.COUNTS).write_text('{"drains.prolog": "lots"')
    break_gpu(tmp)
    run = fresh(env)
    with caplog.at_level(logging.ERROR):
        assert entry.prolog(run) == 1
    assert slurm.log[0] == "drain c3"
    assert drains(tmp) == {"prolog": 1, "epilog": 0, "periodic": 0}  # counted from 0 again
    assert any("counters reset to 0" in r.getMessage() and r.levelno == logging.ERROR
               for r in caplog.records)
    doc = json.loads((tmp / "state" / gatingmetrics.COUNTS).read_text())
    assert doc["drains.prolog"] == 1


@pytest.mark.parametrize("bad", ["[1, 2]", '{"resumes": -3}', '{"resumes": true}', "\x00\xff"])
def test_counts_that_are_not_counts_are_refused(tmp_path: Path, bad: str) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "c.json").write_text(bad)
    numbers, why = counterfile.read(str(state), "c.json")
    assert numbers == {} and why


def test_a_metrics_write_that_fails_never_fails_the_prolog(node, caplog) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    prom = tmp / "prom"
    prom.mkdir()
    prom.chmod(0o777)  # anyone could plant files here: refused
    break_gpu(tmp)
    run = fresh(env)
    with caplog.at_level(logging.ERROR):
        assert entry.prolog(run) == 1 and slurm.log == ["drain c3", "requeue 7"]
    assert "state" in run.problems  # a self error, in syslog
    assert any(f"{GATING} not written" in r.getMessage() and "writable by group or others"
               in r.getMessage() for r in caplog.records)
    assert not (prom / GATING).exists()


def test_an_unforeseen_error_in_the_metrics_never_fails_the_prolog(node, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node

    def bug(*args: object, **kwargs: object) -> None:
        raise TypeError("a bug")

    monkeypatch.setattr(gatingmetrics, "record", bug)
    monkeypatch.setattr(gatingmetrics, "write", bug)
    break_gpu(tmp)
    run = fresh(env)
    assert entry.prolog(run) == 1 and slurm.log == ["drain c3", "requeue 7"]
    assert "a bug" in run.problems["state"]


def test_a_hung_metrics_write_is_cut_short_and_the_prolog_still_fails_the_job(node, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    env, slurm, tmp = node
    monkeypatch.setattr(entry, "METRICS_S", 0.2)

    def hang(*args: object, **kwargs: object) -> None:
        time.sleep(30)  # a stuck filesystem: only the bound ends it

    monkeypatch.setattr(gatingmetrics, "write", hang)
    break_gpu(tmp)
    run = fresh(env)
    started = time.monotonic()
    assert entry.prolog(run) == 1 and slurm.log == ["drain c3", "requeue 7"]
    assert time.monotonic() - started < 10
    assert "not written" in run.problems["state"]


def test_a_short_run_leaves_the_write_for_the_next_one(node) -> None:  # type: ignore[no-untyped-def]
    env, _, tmp = node
    run = replace(fresh(env), end=0.0, mono=lambda: 0.5)  # past its end: no time for it
    entry.report_gating(run, always=True)
    assert not (tmp / "prom" / GATING).exists()
    assert "no time left" in run.problems["state"]


def test_a_broken_config_says_gating_is_off_and_keeps_the_counts(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from tests.fakes import FakeSlurm
    from tests.unit.test_gate import fleet

    state = tmp_path / "state"
    counterfile.update(str(state), gatingmetrics.COUNTS, {"drains.periodic": 3})
    broken = tmp_path / "broken.toml"
    broken.write_text(f"[health]\nprom_dir = '{tmp_path / 'prom'}'\nstate_dir = '{state}'\n"
                      "drian = true\n")
    slurm = FakeSlurm({n.name: n for n in fleet()})
    code, _ = hook(["health", "periodic"], str(broken), monkeypatch, slurm)
    assert code == 0
    assert 'reason="config"} 1' in self_prom(tmp_path)
    assert series(tmp_path, "gpuwarden_health_gating_enabled") == 0
    assert series(tmp_path, "gpuwarden_health_drains_total", hook="periodic") == 3


def test_events_are_counted_as_the_catalogue_says() -> None:
    held = Applied("held", "would drain: x (blast-radius cap: ...)", by_cap=True)
    assert gatingmetrics.event(held, "prolog", "").add == {"drains_held": 1}
    assert gatingmetrics.event(held, "prolog", "").put == {"drain_held": 1}
    # Held for want of time, or by drain = false: not the cap's.
    short = Applied("held", "would drain: x (only 0.5 s left in this run ...)")
    assert gatingmetrics.event(short, "periodic", "").add == {}
    assert gatingmetrics.event(short, "periodic", "").put == {"drain_held": 0}
    # A drain an earlier run made and never ranked, kept now: counted under its own hook.
    kept = Applied("kept", "...")
    reason = "gpuwarden: epilog: XID 79 on GPU 2 [health]"
    assert gatingmetrics.event(kept, "periodic", reason).add == {"drains.epilog": 1}
    assert gatingmetrics.event(Applied("none", "healthy"), "periodic", "").add == {}
    with pytest.raises(ValueError, match="hook"):
        gatingmetrics.event(held, "manual", "")


def test_the_hooks_of_the_catalogue_are_the_reasons_origins() -> None:
    assert metrics.HOOKS == reasons.ORIGINS
    assert metrics.OWNERS == reasons.OWNERS


def test_a_run_beside_another_never_writes_counts_older_than_the_textfile_s(
        node, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The periodic check writes its textfile while a prolog beside it counts a drain and
    writes its own: the periodic's must not land last with the counts from before the drain
    (the counter would go backwards, and Prometheus' increase() takes that as a reset: a spike
    of every drain ever made)."""
    env, _, tmp = node
    state_dir = env.config.health.state_dir
    entry.periodic(fresh(env))  # the file exists, drains 0
    real = gatingmetrics.write
    waiting: list[str] = []

    def prolog_beside() -> None:
        gatingmetrics.record(state_dir, gatingmetrics.Event(drain_hook="prolog"), wait_s=0)
        counts, _ = gatingmetrics.stored(state_dir)
        real(env.config.health.prom_dir, "c3", counts, True)

    def periodic_write(prom_dir: str, node_: str, counts: dict[str, float],
                       enabled: bool) -> None:
        if not waiting:
            waiting.append("prolog")
            try:  # the prolog runs now, unless it must wait for this run's lock
                prolog_beside()
                waiting.pop()
            except counterfile.StateDirError:
                pass
        real(prom_dir, node_, counts, enabled)

    monkeypatch.setattr(gatingmetrics, "write", periodic_write)
    entry.report_gating(fresh(env), always=True)
    monkeypatch.setattr(gatingmetrics, "write", real)
    if waiting:  # the lock is free again: the prolog goes on
        prolog_beside()
    assert gatingmetrics.stored(state_dir)[0]["drains.prolog"] == 1
    assert drains(tmp)["prolog"] == 1
