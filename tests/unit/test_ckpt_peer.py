"""Tier 1 (peer replicas), the ranks' coordination, and the job-level checkpointer."""

from __future__ import annotations

import os
import socket
import socketserver
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from gpuwarden.ckpt import codec
from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.coord import CoordError, FileCoordinator, agree, newest_common
from gpuwarden.ckpt.coordnet import NetCoordinator
from gpuwarden.ckpt.coordsrv import CoordServer
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.job import JobCheckpointer, JobEnv, JobEnvError, job_env
from gpuwarden.ckpt.manifest import Manifest
from gpuwarden.ckpt.peer import Address, PeerError, PeerServer, PeerTier, job_key, partners
from gpuwarden.ckpt.peerwire import MAGIC
from gpuwarden.ckpt.peerwire import recv_frame as _recv_frame
from gpuwarden.ckpt.peerwire import send_frame as _send_frame
from gpuwarden.config.ckpt import CkptConfig

KEY = b"k" * 32


def state(step: int, rank: int = 0) -> dict[str, object]:
    return {"w": np.full((128, 64), step + rank / 10, dtype=np.float32), "tag": f"{step}".encode()}


def manifest(step: int, rank: int = 0, world: int = 2) -> tuple[Manifest, dict[str, memoryview]]:
    shards, data = codec.encode(state(step, rank))
    return Manifest("job-7", step, world, rank, tuple(shards), time.time(), {}), data


@pytest.fixture
def server(tmp_path: Path):  # type: ignore[no-untyped-def]
    srv = PeerServer(KEY, "job-7", str(tmp_path / "nodeB"), keep=2, host="127.0.0.1")
    yield srv
    srv.stop()


def addr(srv: PeerServer) -> Address:
    return Address("127.0.0.1", srv.port)


# ---- partners ---------------------------------------------------------------------------------
def test_partners_sit_on_another_node_and_by_default_another_leaf_switch() -> None:
    hosts = ["c1", "c2", "c5", "c6"]
    leaf = {"c1": "s1", "c2": "s1", "c5": "s2", "c6": "s2"}
    assert partners(0, hosts, leaf, 1) == [2]  # c5, not c2 next door on s1
    assert partners(0, hosts, leaf, 1, "next-node") == [1]
    assert partners(3, hosts, leaf, 2) == [0, 1]
    assert partners(0, ["c1", "c1", "c2"], {}, 1) == [2]  # never the rank's own node
    assert partners(0, ["c1", "c1"], {}, 1) == []  # one node: no replica possible
    assert partners(1, hosts, {}, 1) == [2]  # no topology: the next node


# ---- the wire ---------------------------------------------------------------------------------
def test_a_pushed_replica_is_restored_bit_identical_by_a_rank_on_a_new_node(
        server: PeerServer, tmp_path: Path) -> None:
    m, data = manifest(10, rank=1)
    PeerTier(KEY, "job-7", 1, [addr(server)], []).commit(m, data)
    newcomer = PeerTier(KEY, "job-7", 1, [], [addr(server)])
    assert newcomer.steps() == [10]
    got, shards = newcomer.load(10)
    assert got == m and {k: bytes(v) for k, v in data.items()} == shards
    # Held in node B's memory under the job's replica namespace, private like tier 0.
    held = tmp_path / "nodeB" / "job-7.peer" / "rank-00001"
    assert (held / "step-000000000010" / "MANIFEST.json").is_file()
    assert os.stat(held).st_mode & 0o777 == 0o700


def test_peers_keep_only_the_newest_replicas(server: PeerServer) -> None:
    tier = PeerTier(KEY, "job-7", 0, [addr(server)], [addr(server)])
    for step in (1, 2, 3, 4):
        tier.commit(*manifest(step))
    assert tier.steps() == [3, 4]


def test_another_job_cannot_write_or_read_replicas(server: PeerServer, tmp_path: Path) -> None:
    PeerTier(KEY, "job-7", 0, [addr(server)], []).commit(*manifest(5))
    intruder = PeerTier(b"x" * 32, "job-7", 0, [addr(server)], [addr(server)])
    with pytest.raises(PeerError):
        intruder.commit(*manifest(6))
    with pytest.raises(PeerError, match=r"127\.0\.0\.1:\d+: .*refused ours"):
        intruder.steps()  # its list requests are refused: it learns nothing, and says so
    owner = PeerTier(KEY, "job-7", 0, [], [addr(server)])
    assert owner.steps() == [5]  # nothing was overwritten or added


def test_a_rogue_listener_cannot_feed_a_rank_fake_steps() -> None:
    class Rogue(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            _send_frame(self.request, MAGIC + b"n" * 32)
            for _ in range(3):  # the client's nonce, header and its MAC
                _recv_frame(self.request)
            _send_frame(self.request, b'{"ok": true, "steps": [999]}')
            _send_frame(self.request, b"\0" * 32)  # no key, no valid MAC
    srv = socketserver.TCPServer(("127.0.0.1", 0), Rogue)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        tier = PeerTier(KEY, "job-7", 0, [], [Address("127.0.0.1", srv.server_address[1])])
        with pytest.raises(PeerError, match="does not hold this job's key"):
            tier.steps()
        assert 999 not in tier._where
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_dead_peer_is_an_error_naming_it_not_a_hang() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tier = PeerTier(KEY, "job-7", 0, [Address("127.0.0.1", port)], [], timeout=2)
    with pytest.raises(PeerError, match=f"127.0.0.1:{port}"):
        tier.commit(*manifest(1))


def test_job_key_is_one_private_key_for_all_ranks(tmp_path: Path) -> None:
    keys = [job_key(str(tmp_path)) for _ in range(3)]
    assert len(set(keys)) == 1 and len(keys[0]) == 32
    assert os.stat(tmp_path / "peer.key").st_mode & 0o777 == 0o600
    os.chmod(tmp_path / "peer.key", 0o644)
    with pytest.raises(PeerError, match="private"):
        job_key(str(tmp_path))
    os.unlink(tmp_path / "peer.key")
    os.symlink("/etc/hostname", tmp_path / "peer.key")
    with pytest.raises(OSError):
        job_key(str(tmp_path))


# ---- coordination -----------------------------------------------------------------------------
def test_ranks_agree_on_the_newest_step_all_of_them_hold(tmp_path: Path) -> None:
    assert newest_common([[5, 10, 15], [5, 10], [10, 15]]) == 10
    assert newest_common([[5], [6]]) is None
    held = {0: [5, 10, 15], 1: [5, 10], 2: [10, 15, 20]}
    results: dict[int, int | None] = {}

    def rank(r: int) -> None:
        results[r] = agree(FileCoordinator(str(tmp_path), r, 3), "agree-r1-s0", held[r], 10)
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: 10, 1: 10, 2: 10}


def test_a_rank_that_never_reports_is_named(tmp_path: Path) -> None:
    coord = FileCoordinator(str(tmp_path), 0, 3)
    with pytest.raises(CoordError, match=r"ranks 1,2 did not report"):
        coord.exchange("agree-r0-s0", [1], timeout=0.3)
    (tmp_path / "coord" / "bad-r0.rank-1").write_text("{not json")
    with pytest.raises(CoordError, match="not JSON"):
        FileCoordinator(str(tmp_path), 0, 2).exchange("bad-r0", [], timeout=1)


def test_retention_keeps_the_step_a_dead_rank_needs(tmp_path: Path) -> None:
    """Rank 1 dies after step 10 is durable; rank 0 trains on to step 50 with keep=2. Step 10
    must survive on rank 0's shared tier: the restart restores it on every rank."""
    coords = [FileCoordinator(str(tmp_path / "fsx" / "job-7"), r, 2) for r in range(2)]
    for c in coords:
        c.floor_ttl_s = 0  # no caching: the test runs in less than its 10 s
    cks = [Checkpointer("job-7", FsTier("shm", str(tmp_path / f"shm{r}"), "job-7", r),
                        [FsTier("fsx", str(tmp_path / "fsx"), "job-7", r)], rank=r,
                        world_size=2, keep=2, coord=coords[r])
           for r in range(2)]
    for step in (5, 10):
        for r, ck in enumerate(cks):
            ck.save(step, state(step, r))
            assert ck.wait_durable(step, timeout=30)
    cks[1].close()  # rank 1's node is gone
    for step in range(15, 55, 5):
        cks[0].save(step, state(step))
        assert cks[0].wait_durable(step, timeout=30)
    survivor = FsTier("fsx", str(tmp_path / "fsx"), "job-7", 0)
    assert 10 in survivor.steps() and survivor.steps()[-1] == 50
    assert 5 not in survivor.steps()  # older than what every rank holds: gone
    cks[0].close()


# ---- the job level ----------------------------------------------------------------------------
def test_job_env_names_what_is_wrong() -> None:
    env = job_env({"SLURM_JOB_ID": "42", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
                   "SLURM_RESTART_COUNT": "1", "SLURMD_NODENAME": "c5"})
    assert (env.job, env.rank, env.world_size, env.restarts, env.node) == ("job-42", 3, 4, 1, "c5")
    with pytest.raises(JobEnvError, match="SLURM_JOB_ID"):
        job_env({"SLURM_JOB_ID": "../x", "SLURM_PROCID": "0"})
    with pytest.raises(JobEnvError, match="SLURM_PROCID=4"):
        job_env({"SLURM_JOB_ID": "1", "SLURM_PROCID": "4", "SLURM_NTASKS": "4"})
    with pytest.raises(JobEnvError, match="srun"):
        job_env({"SLURM_JOB_ID": "1"})


@pytest.fixture(params=["file", "net"])
def coordination(request: pytest.FixtureRequest) -> str:
    """How the ranks agree: files on the shared tier, or the job's coordinator (`coordsrv`)
    as on a site without one. Every restore below must come out the same either way."""
    return str(request.param)


def _ranks(tmp_path: Path, world: int, restarts: int, nodes: list[str],
           body: dict[int, object], coordination: str = "file") -> dict[int, object]:
    """Run ``world`` ranks as threads, rank r with tier 0 in ``<tmp>/<nodes[r]>``. With
    ``coordination="net"`` they meet at a coordinator of their own, as a batch script's."""
    out: dict[int, object] = {}
    server = CoordServer(KEY, "job-7", host="127.0.0.1") if coordination == "net" else None

    def run(r: int) -> None:
        cfg = CkptConfig(memory_root=str(tmp_path / nodes[r]), shared_root=str(tmp_path / "fsx"),
                         agree_timeout_s=20, keep=2)
        coord = None if server is None else NetCoordinator(
            f"127.0.0.1:{server.port}", KEY, "job-7", r, world)
        ck = JobCheckpointer(cfg, JobEnv("7", r, world, restarts, "0", nodes[r]), coord=coord,
                             host="127.0.0.1")
        try:
            out[r] = body[r](ck)  # type: ignore[operator]
        finally:
            ck.finish(timeout=30)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        if server is not None:
            server.stop()
    return out


def test_a_replaced_node_restores_from_its_peer_and_all_ranks_take_the_same_step(
        tmp_path: Path, coordination: str) -> None:
    def train(ck: JobCheckpointer) -> int:
        for step in (10, 20):
            ck.save(step, state(step, ck.env.rank))
            assert ck.wait_durable(step, timeout=30)
        return step
    _ranks(tmp_path, 2, 0, ["nodeA", "nodeB"], {0: train, 1: train}, coordination)
    # nodeB's rank never reached step 20 on the shared tier for rank 1 ... simulate: the
    # shared tier lost rank 1's step 20, and nodeB itself is replaced by nodeC.
    import shutil
    shutil.rmtree(tmp_path / "fsx" / "job-7" / "rank-00001" / "step-000000000020")
    shutil.rmtree(tmp_path / "nodeB")

    def resume(ck: JobCheckpointer) -> tuple[int, str, bool]:
        got = ck.restore()
        assert got is not None
        return got.step, got.tier, bool(np.array_equal(got.state["w"],
                                                         state(got.step, ck.env.rank)["w"]))
    out = _ranks(tmp_path, 2, 1, ["nodeA", "nodeC"], {0: resume, 1: resume}, coordination)
    # Rank 1's step 20 lives on only in nodeA's memory, as rank 1's replica.
    assert out == {0: (20, "memory", True), 1: (20, "peer", True)}


def test_without_a_common_step_every_rank_starts_fresh(tmp_path: Path, coordination: str) -> None:
    def first(ck: JobCheckpointer) -> None:
        if ck.env.rank == 0:
            ck.save(5, state(5))
            ck.wait_durable(5, timeout=30)
    _ranks(tmp_path, 2, 0, ["nodeA", "nodeB"], {0: first, 1: first}, coordination)
    out = _ranks(tmp_path, 2, 1, ["nodeA", "nodeB"],
                 {0: lambda ck: ck.restore(), 1: lambda ck: ck.restore()}, coordination)
    assert out == {0: None, 1: None}


def test_a_multi_rank_job_without_a_shared_filesystem_is_refused(tmp_path: Path) -> None:
    with pytest.raises(JobEnvError, match="shared_root"):
        JobCheckpointer(CkptConfig(memory_root=str(tmp_path / "m")),
                        JobEnv("7", 0, 2, 0, "0", "c1"))


def test_a_stop_request_makes_every_rank_save_the_same_step(tmp_path: Path, coordination: str) -> None:
    """The time-limit signal reaches the ranks at slightly different steps: the first to
    notice proposes a step a little ahead, without waiting for anyone (a rank stuck in an
    all-reduce must not be waited for), and every rank stops and saves at that one step."""
    noticed = {0: 130, 1: 131}

    def body(ck: JobCheckpointer) -> tuple[int | None, int | None]:
        before = ck.stop_step(noticed[ck.env.rank])
        ck.stop_requested.set()
        return before, ck.stop_step(noticed[ck.env.rank])
    out = _ranks(tmp_path, 2, 0, ["nodeA", "nodeB"], {0: body, 1: body}, coordination)
    assert out[0] == out[1] and out[0][0] is None and out[0][1] in (132, 133)


def test_the_first_stop_proposal_wins(tmp_path: Path) -> None:
    ranks = [FileCoordinator(str(tmp_path), r, 3) for r in range(3)]
    assert [c.propose("stop-r0-s0", 100 + r) for r, c in enumerate(ranks)] == [100, 100, 100]
    assert sorted(os.listdir(tmp_path / "coord")) == ["stop-r0-s0"]


def test_a_listener_without_the_key_receives_no_replica_bytes() -> None:
    """Another user binding a dead rank's port gets the request header, never the state."""
    got = bytearray()

    class Thief(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            _send_frame(self.request, MAGIC + b"n" * 32)
            self.request.settimeout(2)
            try:
                while chunk := self.request.recv(1 << 16):
                    got.extend(chunk)
            except OSError:
                pass
    srv = socketserver.TCPServer(("127.0.0.1", 0), Thief)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    secret = b"S" * (1 << 20)
    shards, data = codec.encode({"secret": secret})
    m = Manifest("job-7", 1, 2, 0, tuple(shards), time.time(), {})
    try:
        tier = PeerTier(KEY, "job-7", 0, [Address("127.0.0.1", srv.server_address[1])], [],
                        timeout=5)
        with pytest.raises(PeerError, match="127.0.0.1"):
            tier.commit(m, data)
    finally:
        srv.shutdown()
        srv.server_close()
    assert b"SSSSSSSS" not in got and len(got) < 16 << 10


def test_a_restart_never_mixes_in_steps_of_an_abandoned_run(tmp_path: Path, coordination: str) -> None:
    """Run 1: rank 0 reaches step 20, rank 1 dies after step 10. Run 2 restores step 10 on
    both, trains again and saves a new step 20. Rank 0's old step 20 must not stand in for it
    on any tier."""
    def run1(ck: JobCheckpointer) -> None:
        for step in (10, 20) if ck.env.rank == 0 else (10,):
            ck.save(step, state(step, ck.env.rank))
            assert ck.wait_durable(step, timeout=30)
    _ranks(tmp_path, 2, 0, ["nodeA", "nodeB"], {0: run1, 1: run1}, coordination)

    def run2(ck: JobCheckpointer) -> int | None:
        got = ck.restore()
        new = {"w": np.full((128, 64), -1.0, dtype=np.float32), "tag": b"run2"}
        ck.save(20, new)
        assert ck.wait_durable(20, timeout=30)
        return None if got is None else got.step
    assert _ranks(tmp_path, 2, 1, ["nodeA", "nodeB"], {0: run2, 1: run2},
                  coordination) == {0: 10, 1: 10}
    for tier in (FsTier("fsx", str(tmp_path / "fsx"), "job-7", 0),
                 FsTier("shm", str(tmp_path / "nodeA"), "job-7", 0)):
        _, data = tier.load(20)
        assert data["tag"] == b"run2", f"{tier.name} still holds run 1's step 20"


def test_a_step_committed_again_with_other_bytes_replaces_the_old_one_whole(
        tmp_path: Path) -> None:
    tier = FsTier("peer", str(tmp_path), "job-7.peer", 0)
    tier.commit(*manifest(5))
    shards, data = codec.encode({"w": np.zeros(3, dtype=np.float32)})
    newer = Manifest("job-7", 5, 2, 0, tuple(shards), time.time(), {})
    tier.commit(newer, data)
    got, _ = tier.load(5)
    assert got.shards == newer.shards and tier.steps() == [5]
    assert not [n for n in os.listdir(tier.dir) if n.startswith(".")]


def test_ranks_of_one_node_spread_their_replicas_over_the_partner_nodes_ranks() -> None:
    hosts = ["a", "a", "b", "b", "c", "c"]
    assert [partners(r, hosts, {}, 1) for r in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert partners(1, hosts, {}, 2) == [3, 5]
