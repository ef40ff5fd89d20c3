"""What a training job under Slurm calls: the tiers from `[ckpt]`, peers, agreement, signals.

    ck = JobCheckpointer.from_slurm()           # one per rank, under srun; handles SIGUSR1
    got = ck.restore()                           # every rank gets the same step, or None
    for step in ...:
        ...
        stop = ck.stop_step(step)                # SIGUSR1: the time limit is near
        if step % every == 0 or stop == step:
            ck.save(step, state)
        if stop == step:                         # every rank stops at the same step
            ck.finish(step); sys.exit(EXIT_REQUEUE)
    ck.finish(last_step)

The namespace is ``job-<SLURM_JOB_ID>``, the same across requeues (SLURM_RESTART_COUNT only
names the agreement round), so a requeued job finds its own checkpoints and nobody else's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any

from gpuwarden.ckpt import beat, jobkey, restorelog
from gpuwarden.ckpt.build import tiers
from gpuwarden.ckpt.checkpointer import Checkpointer, PendingSave
from gpuwarden.ckpt.coord import CoordError, Coordinator, FileCoordinator, SoloCoordinator, agree
from gpuwarden.ckpt.coordnet import ENV_COORD, NetCoordinator
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.jobkey import JobKeys
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.peer import Address, PeerServer, PeerTier, job_key, partners, read_job_key
from gpuwarden.ckpt.peerwire import PeerError
from gpuwarden.ckpt.restore import COPY_ERRORS, Restored, TiersUnavailable, copy_of
from gpuwarden.config.ckpt import CkptConfig
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.slurm import jobenv

log = logging.getLogger(__name__)

# The training script's exit status after an emergency save: the sbatch template requeues on it.
EXIT_REQUEUE = 75  # EX_TEMPFAIL
# The writer's calls to the job's coordinator (its durable steps, retention's floor): a
# coordinator out of reach costs the write-back this long per call, not the 10 s of an
# agreement call; a call that fails only defers retention to the next commit.
WRITER_OP_S = 3.0
WRAPPER = "gpuwarden ckpt coord --"
RECORD_S = 30.0  # how long `finish` waits for the restore record to reach S3


class JobEnvError(GpuwardenError):
    """The Slurm environment a rank needs is missing or malformed."""


@dataclass(frozen=True)
class JobEnv:
    job_id: str
    rank: int
    world_size: int
    restarts: int
    step_id: str
    node: str

    @property
    def job(self) -> str:
        return f"job-{self.job_id}"

    @property
    def run(self) -> str:
        """This run of the job's ranks (a requeue or a new srun step is another): names the
        coordination rounds, so a round of an earlier run is never read as this one's."""
        return f"r{self.restarts}-s{self.step_id}"


def _int(key: str, raw: str | None) -> int:
    """``raw``, the value of ``key`` (None: unset), as a non-negative integer."""
    if raw is None:
        raise JobEnvError(f"{key} is not set: run this under srun inside a Slurm job")
    if not jobenv.digits(raw, 9):
        raise JobEnvError(f"{key}={raw[:20]!r}: expected a non-negative integer")
    return int(raw)


def job_env(environ: Mapping[str, str]) -> JobEnv:
    job_id = jobenv.valid_job_id(environ)
    if not job_id:
        raise JobEnvError(f"{jobenv.JOB_ID}={jobenv.job_id(environ)[:20]!r}: expected digits "
                          "(run inside a Slurm job)")
    rank = _int(jobenv.PROCID, jobenv.procid(environ))
    ntasks = jobenv.ntasks(environ)
    world = _int(jobenv.NTASKS, "1" if ntasks is None else ntasks)
    if not 0 <= rank < world:
        raise JobEnvError(f"SLURM_PROCID={rank} is outside SLURM_NTASKS={world}")
    step = jobenv.step_id(environ)
    node = jobenv.node_name(environ, socket.gethostname)
    restarts = jobenv.restart_count(environ)
    return JobEnv(job_id, rank, world, _int(jobenv.RESTART_COUNT,
                                            "0" if restarts is None else restarts),
                  step if step.isascii() and step.isdigit() else "0", node)


def _leaves(path: str) -> dict[str, str]:
    from gpuwarden.slurm.topology import leaf_of_file  # noqa: PLC0415 - optional

    return leaf_of_file(path, "peer partners on other nodes only")


def install_stop_signal(stop: threading.Event, signum: int = signal.SIGUSR1) -> None:
    """Slurm's warning before the time limit (``--signal=B:USR1@N``, passed on by the
    template) sets ``stop``: the loop sees it at its next step and saves."""
    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        stop.set()
    signal.signal(signum, on_signal)


class JobCheckpointer:
    def __init__(self, cfg: CkptConfig, env: JobEnv, coord: Coordinator | None = None,
                 host: str | None = None, stop: threading.Event | None = None,
                 beats: beat.Beater | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        """``coord``: how the ranks agree (None: from the site, see `_coordinators`);
        ``environ``: the rank's environment (None: this process's), where the job's
        coordinator address is when there is no shared filesystem."""
        self.cfg, self.env = cfg, env
        self.beats = beats  # heartbeats to `gpuwarden launch`, when it started this step
        self.stop_requested = stop if stop is not None else threading.Event()
        self._stop_at: int | None = None
        self.stop_margin = 2
        self._recording: threading.Thread | None = None  # the restore record's upload
        environ = os.environ if environ is None else environ
        storage = tiers(cfg, env.job, env.rank)
        tier0: FsTier = storage[0]
        shared = next((t for t in storage if t.name == "shared"), None)
        if shared is not None:
            shared.ensure_dir()
        job_dir = None if shared is None else os.path.dirname(shared.dir)
        s3 = next((t for t in storage if t.name == "s3"), None)
        self._s3 = s3
        # The job's keys: S3 cannot tell owners apart (its manifests carry a MAC under them),
        # and the peers and the coordinator admit only the job's ranks by them.
        needed = s3 is not None or (env.world_size > 1 and (job_dir is None
                                                             or cfg.peer_replicas > 0))
        self._keys = self._job_keys(job_dir) if needed else None
        if s3 is not None:
            if self._keys is None:  # the config refuses this; a hand-built one must too
                raise JobEnvError("[ckpt] s3_bucket needs [ckpt] key_file (or shared_root): "
                                  "the job's key authenticates its S3 steps")
            s3.keys = self._keys
        writer: Coordinator | None = coord
        if coord is None:
            coord, writer = self._coordinators(job_dir, environ)
        self.coord = coord
        self.server: PeerServer | None = None
        replicas: list[Any] = []
        if cfg.peer_replicas > 0 and env.world_size > 1 and self._keys is not None:
            replicas.append(self._start_peers(self._keys.signing[1], host))
        self.ck = Checkpointer(env.job, tier0, storage[1:], rank=env.rank,
                               world_size=env.world_size, keep=cfg.keep, replicas=replicas,
                               coord=writer)

    def _job_keys(self, job_dir: str | None) -> JobKeys | None:
        """The prolog's derived keys where the site has ``key_file`` (with the shared tier's
        ``peer.key``, when there is one, to verify what was signed before); else the shared
        tier's random key; None without either. JobKeyError when ``key_file`` is set but the
        job's key file cannot be read (a rank must never sign with a key the others lack)."""
        cfg, env = self.cfg, self.env
        if cfg.key_file:
            keys = jobkey.read_job_keys(cfg.job_key_dir, env.job_id)
            if job_dir is not None:
                with contextlib.suppress(PeerError):  # no peer.key: nothing signed with one
                    keys = keys.with_shared(read_job_key(cfg.shared_root, env.job,
                                                         os.geteuid()))
            log.info("rank %d: job keys %s", env.rank, keys)  # key ids and fingerprints only
            return keys
        if job_dir is not None:
            return JobKeys.shared(job_key(job_dir))
        return None

    def _coordinators(self, job_dir: str | None, environ: Mapping[str, str]
                      ) -> tuple[Coordinator, Coordinator]:
        """How the ranks agree (and the writer's handle on it, with a shorter deadline per
        call): files on the shared tier; else the job's coordinator, which the sbatch
        templates' wrapper starts on the batch host; a job of one rank needs neither."""
        env = self.env
        if job_dir is not None:
            c = FileCoordinator(job_dir, env.rank, env.world_size)
            return c, c
        if env.world_size == 1:
            solo = SoloCoordinator()
            return solo, solo
        addr = environ.get(ENV_COORD, "")
        if not addr or self._keys is None:
            todo = []
            if self._keys is None:
                todo.append("set [ckpt] key_file (the job's key: docs/checkpointing.md)")
            if not addr:
                todo.append(f"run srun under `{WRAPPER}` (the ckpt/train*.sbatch templates "
                            "do)")
            raise JobEnvError("a job of several ranks without [ckpt] shared_root agrees "
                              f"through gpuwarden's coordinator ({ENV_COORD}, keyed with the "
                              f"job's key): {'; '.join(todo)}")
        key = self._keys.signing[1]
        try:
            return (NetCoordinator(addr, key, env.job, env.rank, env.world_size),
                    NetCoordinator(addr, key, env.job, env.rank, env.world_size,
                                   op_timeout_s=WRITER_OP_S))
        except CoordError as exc:
            raise JobEnvError(f"{ENV_COORD}: {exc}") from None

    @classmethod
    def from_slurm(cls, config_path: str | None = None,
                   environ: Mapping[str, str] | None = None) -> JobCheckpointer:
        from gpuwarden.config import load  # noqa: PLC0415 - keeps `import gpuwarden.ckpt` light

        # The handler goes in first: Slurm may send the time-limit warning while the ranks
        # are still meeting each other, and USR1's default action would kill them.
        stop = threading.Event()
        install_stop_signal(stop)
        cfg = load(config_path).ckpt
        environ = os.environ if environ is None else environ
        env = job_env(environ)
        # Before the ranks meet (which waits for all of them): a rank blocked there is alive.
        beats = beat.from_env(environ, env.job_id, env.rank, env.node, env.step_id)
        return cls(cfg, env, stop=stop, beats=beats, environ=environ)

    def _start_peers(self, key: bytes, host: str | None) -> PeerTier:
        env, cfg = self.env, self.cfg
        self.server = PeerServer(key, env.job, cfg.memory_root, keep=cfg.keep,
                                 port=cfg.peer_port)
        me = {"host": host or socket.gethostname(), "port": self.server.port, "node": env.node}
        every = self.coord.exchange(f"peers-{env.run}", me,
                                    self.cfg.agree_timeout_s)
        addrs, nodes = [], []
        for r, p in enumerate(every):
            if not (isinstance(p, dict) and isinstance(p.get("host"), str)
                    and isinstance(p.get("port"), int) and isinstance(p.get("node"), str)):
                raise CoordError(f"rank {r} published {str(p)[:80]!r} as its peer address")
            addrs.append(Address(p["host"], p["port"]))
            nodes.append(p["node"])
        leaf = _leaves(cfg.topology_conf) if cfg.peer_partner == "other-leaf" else {}
        mine = partners(env.rank, nodes, leaf, cfg.peer_replicas, cfg.peer_partner)
        if not mine:
            log.warning("rank %d: no partner on another node: no peer replicas", env.rank)
        else:
            log.info("rank %d: replicas on ranks %s (%s)", env.rank, mine,
                     ", ".join(nodes[r] for r in mine))
        others = [a for r, a in enumerate(addrs) if r != env.rank]
        return PeerTier(key, env.job, env.rank, [addrs[r] for r in mine], others)

    # ---- the training loop's side -----------------------------------------------------------
    def restore(self, read_only: bool = False, durable_only: bool = False,
                mapped: bool = False) -> Restored | None:
        """The newest step every rank can restore, the same on all ranks; None: start fresh.

        Agreement is on what the tiers list; a rank whose copies of the agreed step all fail
        their checks walks back, and then every rank takes that older step too.

        Unless ``read_only``, each rank then deletes its steps newer than the restored one on
        every tier it writes (steps of an abandoned run). ``read_only`` changes no tier: for
        looking at or verifying a job's checkpoints (the ranks still meet in the coordination
        directory).

        Raises `TiersUnavailable` on every rank when some rank could not list a tier and no
        step could be agreed on or restored (it may hold the checkpoint: never a fresh start
        then), and CoordError when the ranks do not meet.

        ``durable_only``: agree on, and restore from, the durable tiers alone, which the other
        ranks read too (`load_rank`): what a DCP load needs. Each rank's restore then verifies
        the very copy the others will read, so a damaged one walks every rank back together.
        A job of one rank with no durable tier restores from node memory as usual.

        ``mapped``: arrays from node memory map its pages copy-on-write instead of copying
        them: no copy and no new memory, but the arrays keep those pages (even once retention
        deletes the step) for as long as they live. For a state the caller copies out at once
        (`load_state_dict` onto a GPU, `np.array(v)`); keep the default for state kept as it is
        (a CPU optimizer's).
        """
        env = self.env
        if durable_only and not self.ck.durable:
            if env.world_size > 1:
                raise JobEnvError("a load of several ranks' items needs a durable tier "
                                  "([ckpt] shared_root or s3_bucket)")
            durable_only = False  # one rank reads only its own items
        mine, failed = self.ck.listing(durable_only=durable_only)
        target = agree(self.coord, f"agree-{env.run}", mine, self.cfg.agree_timeout_s)
        for attempt in range(4):
            if target is None:
                blind = self.coord.exchange(f"fresh-{env.run}-{attempt}", bool(failed),
                                            self.cfg.agree_timeout_s)
                if any(blind):
                    ranks = [r for r, b in enumerate(blind) if b]
                    raise TiersUnavailable(f"rank {env.rank}: ranks {ranks} could not list some "
                                           f"tiers ({'; '.join(failed) or 'see their logs'}): "
                                           "not starting fresh")
                if not read_only:
                    self.ck.forget_newer(None)  # a fresh start: no step of an earlier run counts
                return None
            t0 = time.monotonic()
            try:
                got = self.ck.restore(at_most=target, mapped=mapped, durable_only=durable_only)
            except TiersUnavailable as exc:
                log.error("rank %d: %s", env.rank, exc)
                failed = [*failed, str(exc)]
                got = None  # reported as -1: then every rank fails together, above
            took = time.monotonic() - t0
            reached = -1 if got is None else got.step
            every = self.coord.exchange(f"restored-{env.run}-{attempt}", reached,
                                        self.cfg.agree_timeout_s)
            if not all(isinstance(s, int) and not isinstance(s, bool) for s in every):
                raise CoordError(f"a rank reported {every!r} as its restored step")
            low = min(every)
            if low == target:
                assert got is not None
                log.info("rank %d: restored step %d from %s", env.rank, got.step, got.tier)
                if not read_only:
                    self.ck.forget_newer(got.step)
                    self._record_restore(got, took)
                return got
            log.warning("rank %d: some rank could not restore step %d; all take step %s",
                        env.rank, target, low if low >= 0 else "none")
            target = low if low >= 0 else None
        raise CoordError("the ranks could not agree on a step to restore after 4 rounds")

    def _record_restore(self, got: Restored, took: float) -> None:
        """For the report's restore times per tier (`restorelog`); a failure costs the job
        nothing but a warning. Into the shared tier's coordination directory, else into S3
        (in the background: a slow or absent S3 never holds the training back; `finish`
        waits for it a little)."""
        env = self.env
        rec = restorelog.RestoreRecord(env.job, env.rank, env.run, got.step, got.tier,
                                       got.manifest.total_bytes, round(took, 6), time.time(),
                                       got.manifest.created_at)
        if isinstance(self.coord, FileCoordinator):
            try:
                self.coord.record(rec.name, rec.doc())
            except OSError as exc:
                log.warning("rank %d: cannot record the restore's time: %s", env.rank, exc)
            return
        if self._s3 is None or self._keys is None:
            return  # neither tier: nowhere an admin reads from
        sink = restorelog.S3RecordSink(self._s3.s3, self._s3.s.bucket, self._s3.s.prefix,
                                       env.job, self._keys)

        def write() -> None:
            try:
                sink.record(rec.name, rec.doc())
            except Exception as exc:  # boto3's errors, whatever they are: only a warning
                log.warning("rank %d: cannot record the restore's time in %s: %s", env.rank,
                            sink, exc)
        self._recording = threading.Thread(target=write, name="gpuwarden-restore-record",
                                           daemon=True)
        self._recording.start()

    def save(self, step: int, state: Mapping[str, Any]) -> Manifest:
        m = self.ck.save(step, state)
        self.progress(step)
        return m

    def begin(self, step: int, state: Mapping[str, Any]) -> PendingSave:
        """`save` in two halves, for a value known only later (`Checkpointer.begin`)."""
        pending = self.ck.begin(step, state)
        self.progress(step)
        return pending

    def progress(self, step: int) -> None:
        """Tell `gpuwarden launch` that training reached ``step`` (saves do it too): it tells
        a hung job from a slow one by this. Does nothing outside `gpuwarden launch`."""
        if self.beats is not None:
            self.beats.progress(step)

    def load_rank(self, rank: int, step: int) -> dict[str, Any]:
        """Another rank's ``step`` from the durable tiers (shared filesystem, then S3),
        verified: for DCP, whose ranks read items other ranks wrote (a replicated tensor is
        written once). Raises TiersUnavailable when no durable tier has a good copy."""
        if not 0 <= rank < self.env.world_size:
            raise TiersUnavailable(f"rank {self.env.rank}: no rank {rank} in a job of "
                                   f"{self.env.world_size}")
        storage = tiers(self.cfg, self.env.job, rank)[1:]
        why: list[str] = []
        for t in storage:
            if t.name == "s3":
                t.keys = self._keys
            try:
                return copy_of(t, step)[1]
            except COPY_ERRORS as exc:
                why.append(str(exc))
        raise TiersUnavailable(f"rank {self.env.rank}: step {step} of rank {rank} is on no "
                               f"durable tier in a form that passes its checks ({'; '.join(why)})")

    def wait_durable(self, step: int, timeout: float | None = None) -> bool:
        return self.ck.wait_durable(step, timeout)

    def stop_step(self, step: int) -> int | None:
        """None while no stop was requested; then the step every rank stops and saves at.

        Never blocks: the first rank to notice the request proposes ``step + stop_margin``
        in a file (created exclusively: one proposal wins), and every rank that notices reads
        it. A rank blocked in a collective (an all-reduce) until its peers arrive is then
        never waited for. A rank already past the proposal (ranks far out of step) saves
        where it is and says so; the restart then agrees on an older common step.
        """
        if not self.stop_requested.is_set():
            return None
        if self._stop_at is None:
            env = self.env
            self._stop_at = self.coord.propose(f"stop-{env.run}", step + self.stop_margin)
            if step > self._stop_at:
                log.error("rank %d: already at step %d, past the agreed stop step %d: saving "
                          "here (the restart falls back to a step every rank holds)", env.rank,
                          step, self._stop_at)
                self._stop_at = step
            log.info("rank %d: stop requested at step %d; every rank saves step %d", env.rank,
                     step, self._stop_at)
        return self._stop_at

    def finish(self, step: int | None = None, timeout: float | None = 600.0) -> bool:
        """Wait until ``step`` is durable (if given), then stop the writer and the peer server.
        False when the step did not become durable in time."""
        if self.beats is not None:
            self.beats.done()  # no more progress from here: not a hang, nor a loss once silent
        ok = True
        if step is not None:
            ok = self.ck.wait_durable(step, timeout)
            if not ok:
                log.error("rank %d: step %d is not durable after %s s", self.env.rank, step,
                          timeout)
        self.ck.close(timeout=60)
        if self._recording is not None:
            self._recording.join(RECORD_S)
        if self.env.world_size > 1:
            # Every rank done writing: the peer server has served the partners' last pushes,
            # and every rank's last durable (and node memory's) step is published, so the
            # last retention pass leaves exactly `keep` steps (a rank closing first kept what
            # the others still needed then).
            env = self.env
            try:
                self.coord.exchange(f"finish-{env.run}", env.rank,
                                    min(self.cfg.agree_timeout_s, 30.0))
            except CoordError as exc:
                log.warning("rank %d: not every rank finished: %s", env.rank, exc)
            else:
                self.ck.prune_tier0()
                self.ck.prune_durable()
            if self.server is not None:
                self.server.stop()
        return ok
