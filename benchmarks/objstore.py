"""The object-store site's three ratios in one run, the S3 link shaped like a remote object
store's (issue 37; docs/design/object-store-sites.md 5.4).

On a test cluster of the objstore site (no /fsx; checkpoints in node memory, on peers and in S3,
each job's key derived by the prolog from the site secret), with `--shape DELAY,RATE` (default
15ms,1gbit; devcluster/s3shape.py: every node's downloads share the s3 container's uplink, each
node's uploads to S3 capped on its own) on for every arm and taken off at the end whatever
happens:

1. restore: S3 against tier 0 (node memory), each reading, verifying and decoding the same
   `--mb` MiB (4 shards) on node c1, as a job's restore does (`restore.copy_of`). Goal >= 13
   (Gemini's figure for CPU memory against remote storage).
2. download: boto3's `download_file` of the same 4 shard objects into /dev/shm with a
   `TransferConfig` of the tier's own part size and concurrency (`[ckpt] s3_get_part_mb`,
   `s3_get_concurrency`) and the same client settings, against gpuwarden's `S3Tier.load`
   (parallel ranged GETs, verified as they land, the manifest and its MAC read and checked
   first). Ratio boto3 / gpuwarden, goal >= 1.0.
3. recovery (skipped with `--skip-recovery`: it takes minutes): 3 ranks of ckpt/train_example.py
   with `--rank-mb` MiB each lose a training node (`docker kill`) once step 10 of every rank is
   in S3's authenticated index; once with one spare (`train_spares.sbatch`, `sbatch -N4`,
   `--deadline-s 5`), once requeued by Slurm (`train.sbatch`, `sbatch -N3`: stage-in from S3 on
   the new node). Recovery: from the kill to every rank's "restored step" line in the job's
   output (polled every 0.5 s). Ratio spare / requeue, goal <= 0.25 (issue 18's).

Arms 1 and 2 run each measurement in a process of its own inside c1 (so every one starts with
cold connections), `--repeat` times (at least 3) in alternating order, and compare medians.
They use a job name and a random key of their own (S3 needs a key to authenticate manifests);
the S3 credentials are the node's (`[ckpt] stage_in_s3_env`, root's, read as the prolog reads
them). The recovery arm's jobs get S3 credentials in their environment as a user's would (in the
`docker exec` environment of `sbatch`, never on a command line); the waiter for step 10 derives
each job's key from the site secret as root, as the prolog's stage-in does. Every ratio is of
figures measured in this run.

Output: the probe's RTT (a 1-byte GET from c1, connection warm) in the header, then each ratio
with its seconds, goal and PASS/FAIL. Exit 0: every goal met; 1: a goal missed; 2: no verdict
(not an objstore cluster, not up, the S3 relay or its redirect failed, the shaping not in effect,
or a step of the run that failed: the message says which).

    GPUWARDEN_CLUSTER_NAME=gwobj GPUWARDEN_SITE=objstore .venv/bin/python -m devcluster up
    GPUWARDEN_CLUSTER_NAME=gwobj GPUWARDEN_SITE=objstore .venv/bin/python benchmarks/objstore.py \\
        [--mb 256] [--shape 15ms,1gbit | --shape none] [--repeat 3] [--skip-recovery]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import secrets
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from devcluster import s3shape
from devcluster.cluster import VENV_PYTHON, Cluster
from devcluster.exec import run_in
from devcluster.harness import LOCAL_JOBS_DIR, TERMINAL, TRAIN_SBATCH, Harness, job_status
from devcluster.spec import Spec, from_env
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.slurm import parse

SPARES_SBATCH = "/opt/gpuwarden/ckpt/train_spares.sbatch"
NODE = "c1"  # where arms 1 and 2 run, and the probe
SHARDS = 4  # the state's arrays: 256 MiB is 4 shards of 64 (design 5.4)
RANKS = 3  # the recovery arm's training ranks
KILL_AT = 10  # the step every rank holds in S3's index when the node is killed
USER = "alice"  # who submits the recovery arm's jobs
PROBE_GETS = 5
POLL_S = 0.5
RESTORE_GOAL, DOWNLOAD_GOAL, RECOVERY_GOAL = 13.0, 1.0, 0.25
EXIT_PASS, EXIT_FAIL, EXIT_NO_VERDICT = 0, 1, 2
INSIDE_TIMEOUT_S = 900.0  # one measurement inside c1, a slow shape included

_RESTORED = re.compile(r"^rank (\d+): restored step (\d+) from (\w+)", re.MULTILINE)
_DELAY_MS = re.compile(r"([0-9]+(?:\.[0-9]+)?)ms")


class NoResult(Exception):
    """The run cannot give a verdict (refused before it started, or a step of it failed)."""


# ---- pure parts (tests/unit/test_bench_objstore.py) ----------------------------------------------
def parse_shape(text: str) -> s3shape.Shape | None:
    """`--shape`: "DELAY,RATE" (15ms,1gbit) as s3shape's Shape, or "none" for an unshaped link."""
    if text.strip().lower() == "none":
        return None
    try:
        return s3shape.Shape.parse(text)
    except s3shape.ShapeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc} (DELAY,RATE like 15ms,1gbit, or "
                                         "none)") from None


def delay_ms(shape: s3shape.Shape) -> float:
    m = _DELAY_MS.fullmatch(shape.delay)
    if m is None:  # Shape checked it already
        raise ValueError(f"delay {shape.delay!r}")
    return float(m.group(1))


def shaping_seen(rtt_ms: float, shape: s3shape.Shape | None) -> bool:
    """Whether a probe's round trip shows the shaping: the delay is paid each way (the s3
    container's egress and the node's), so a round trip takes at least twice it (10% slack for
    timer granularity). An unshaped link passes."""
    return shape is None or rtt_ms >= 0.9 * 2 * delay_ms(shape)


def multiple_of_shards(text: str) -> int:
    mb = int(text)
    if mb < SHARDS or mb % SHARDS:
        raise argparse.ArgumentTypeError(f"{mb}: a multiple of {SHARDS} MiB ({SHARDS} shards), "
                                         f"at least {SHARDS}")
    return mb


def at_least(low: int) -> Callable[[str], int]:
    def check(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"{n}: at least {low}")
        return n
    return check


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0].replace("\n", " "),
        epilog="The cluster: GPUWARDEN_CLUSTER_NAME and GPUWARDEN_SITE=objstore, as `python -m "
               "devcluster up` was given them. Exit 0 every goal met, 1 a goal missed, 2 no "
               "verdict.")
    ap.add_argument("--mb", type=multiple_of_shards, default=256,
                    help="state size for ratios 1 and 2, MiB, in 4 shards (default 256)")
    ap.add_argument("--shape", type=parse_shape, default=parse_shape("15ms,1gbit"),
                    metavar="DELAY,RATE", help="the S3 link for every arm: delay each way and "
                    "rate (default 15ms,1gbit), or none: unshaped (any shaping taken off first)")
    ap.add_argument("--repeat", type=at_least(3), default=3,
                    help="runs of each measurement of ratios 1 and 2, interleaved; the medians "
                    "are compared (default 3, at least 3)")
    ap.add_argument("--rank-mb", type=at_least(1), default=8,
                    help="each rank's state in the recovery arm, MiB (default 8)")
    ap.add_argument("--skip-recovery", action="store_true",
                    help="ratios 1 and 2 only (the recovery arm takes minutes)")
    return ap.parse_args(argv)


def ratio(num: float, den: float, what: str) -> float:
    if not den > 0:
        raise NoResult(f"{what}: a time of {den} s to divide by")
    return num / den


def interleaved(run: int, arms: tuple[str, str]) -> tuple[str, str]:
    """The order of two arms in run ``run`` (0-based): alternating, so neither always goes
    first (a warmer server, page cache)."""
    return arms if run % 2 == 0 else (arms[1], arms[0])


def seconds(samples: Sequence[float]) -> str:
    """"2.412 s (median of 3: 2.380, 2.412, 2.551)"."""
    runs = ", ".join(f"{s:.3f}" for s in samples)
    return f"{statistics.median(samples):.3f} s (median of {len(samples)}: {runs})"


@dataclass(frozen=True)
class Verdict:
    """One ratio against its goal."""

    name: str  # "S3 restore / tier-0 restore"
    value: float
    op: str  # ">=" or "<="
    goal: float
    figures: str  # what the ratio is of, with seconds

    def __post_init__(self) -> None:
        if self.op not in (">=", "<="):
            raise ValueError(f"goal operator {self.op!r}: >= or <=")

    @property
    def passed(self) -> bool:
        return self.value >= self.goal if self.op == ">=" else self.value <= self.goal

    def line(self) -> str:
        return (f"{self.name}: {self.value:.2f} (goal {self.op} {self.goal:g}): "
                f"{'PASS' if self.passed else 'FAIL'}\n    {self.figures}")


def exit_code(verdicts: Sequence[Verdict]) -> int:
    """0 when every goal is met, 1 when one is missed, 2 when there is nothing to judge."""
    if not verdicts:
        return EXIT_NO_VERDICT
    return EXIT_PASS if all(v.passed for v in verdicts) else EXIT_FAIL


def summary(verdicts: Sequence[Verdict]) -> str:
    met = sum(v.passed for v in verdicts)
    word = "PASS" if exit_code(verdicts) == EXIT_PASS else "FAIL"
    return f"{word}: {met} of {len(verdicts)} goals met"


def restored_ranks(text: str) -> set[int]:
    """The ranks that printed "rank R: restored step S from TIER" in ``text``."""
    return {int(m.group(1)) for m in _RESTORED.finditer(text)}


class Link(Protocol):
    def shape(self, how: s3shape.Shape) -> None: ...
    def unshape(self) -> None: ...


@contextlib.contextmanager
def shaped(link: Link, how: s3shape.Shape | None, say: Callable[[str], None]) -> Iterator[None]:
    """The S3 link as ``how`` says for the block, unshaped after it whatever happens (a shaping
    that failed half way too). ``None``: unshaped for the block (a shaping left by `shape-s3`
    would make an "unshaped" run a shaped one)."""
    if how is None:
        link.unshape()
        say("S3 link unshaped (--shape none)")
        yield
        return
    try:
        say(f"shaping the S3 link: {how.delay} each way, {how.rate}")
        link.shape(how)
        yield
    finally:
        try:
            link.unshape()
            say("S3 link unshaped")
        except Exception as exc:  # the run's own error (if any) matters more: say, go on
            print(f"objstore benchmark: WARNING: could not unshape the S3 link ({exc}); run "
                  "`python -m devcluster unshape-s3` with the same environment", file=sys.stderr,
                  flush=True)


# ---- inside node c1 --------------------------------------------------------------------------------
# One measurement per process: `python -c _INSIDE MODE ARGS...`; in the environment the node's
# config and the bench's tier-0 spool (GPUWARDEN_BENCH_CONFIG, _SHM), the bench job and its key
# (GPUWARDEN_BENCH_JOB, _KEY). Prints one JSON line.
CONFIG = "/etc/gpuwarden/gpuwarden.toml"
BENCH_SHM = "/dev/shm/gpuwarden-bench"  # noqa: S108 - in the node: its tier-0 tmpfs
_INSIDE = r'''
import json, os, pwd, shutil, sys, time
from gpuwarden.config import load
from gpuwarden.ckpt.s3tier import S3Settings, S3Tier, client

SHM = os.environ["GPUWARDEN_BENCH_SHM"]
STEP = 1
mode, args = sys.argv[1], sys.argv[2:]
cfg = load(os.environ["GPUWARDEN_BENCH_CONFIG"], missing_ok=False)
c = cfg.ckpt

def out(**kw):
    print(json.dumps(kw), flush=True)

if mode == "info":
    st = os.statvfs(os.path.dirname(SHM))
    out(cluster=cfg.cluster.name, bucket=c.s3_bucket, shared_root=c.shared_root,
        key_file=c.key_file, stage_in_s3_env=c.stage_in_s3_env, fsx=os.path.lexists("/fsx"),
        shm_free_mb=st.f_bavail * st.f_frsize >> 20, part_mb=c.part_size_mb,
        concurrency=c.concurrency, get_part_mb=c.s3_get_part_mb,
        get_concurrency=c.s3_get_concurrency)
    sys.exit(0)

from gpuwarden.ckpt.stagein_s3 import read_env_file
# The tier's settings as a job builds them (ckpt/build.py), the node's credentials (root's).
settings = S3Settings(c.s3_bucket, c.s3_prefix, c.s3_endpoint or None, c.part_size_mb << 20,
                      c.concurrency, get_part_size=c.s3_get_part_mb << 20,
                      get_concurrency=c.s3_get_concurrency)
s3 = client(settings, read_env_file(c.stage_in_s3_env))

if mode == "index":
    # Step KILL_AT in S3's authenticated index: the job's key derived as root, from the site
    # secret, as the prolog's stage-in derives it (stagein_s3.with_secrets).
    from gpuwarden.ckpt import jobkey
    job_id, user, world = args[0], args[1], int(args[2])
    keys = jobkey.JobKeys.of(jobkey.derive(jobkey.load_site_keys(c.key_file), cfg.cluster.name,
                                           job_id, pwd.getpwnam(user).pw_uid))
    index = S3Tier("s3", settings, "job-" + job_id, s3=s3, keys=keys).index()
    done = index.complete(world)
    out(step=done[0] if done else None, ranks=len(index.held(world)), refused=index.refused)
    sys.exit(0)

from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.restore import copy_of
job = os.environ["GPUWARDEN_BENCH_JOB"]
s3t = S3Tier("s3", settings, job, s3=s3, key=bytes.fromhex(os.environ["GPUWARDEN_BENCH_KEY"]))
memory = FsTier("memory", SHM, job, map_reads=True)
probe_key = f"{c.s3_prefix}/{job}/probe"

def timed(fn):
    t = time.perf_counter(); got = fn(); return time.perf_counter() - t, got

if mode == "probe":
    s3.put_object(Bucket=c.s3_bucket, Key=probe_key, Body=b"x")
    get = lambda: s3.get_object(Bucket=c.s3_bucket, Key=probe_key)["Body"].read()
    get()  # the connection, warm: the probe is of the link, not of a TCP handshake
    ms = [timed(get)[0] * 1000 for _ in range(int(args[0]))]
    s3.delete_object(Bucket=c.s3_bucket, Key=probe_key)
    out(ms=ms)
elif mode == "put":
    import numpy as np
    from gpuwarden.ckpt import codec
    from gpuwarden.ckpt.manifest import Manifest
    mb, shards = int(args[0]), int(args[1])
    rng = np.random.default_rng(1)
    n = (mb << 18) // shards
    state = {f"w{i}": rng.random(n, dtype=np.float32) for i in range(shards)}
    got, data = codec.encode(state)
    m = Manifest(job, STEP, 1, 0, tuple(got), time.time(), {})
    memory.commit(m, data)
    up_s, _ = timed(lambda: s3t.commit(m, data))
    out(bytes=m.total_bytes, shards=len(got), upload_s=up_s)
elif mode in ("t0", "s3"):
    took, (m, state) = timed(lambda: copy_of(memory if mode == "t0" else s3t, STEP))
    if sum(a.nbytes for a in state.values()) != m.total_bytes:
        sys.exit("restored state of the wrong size")
    out(s=took)
elif mode == "ours":
    took, (m, data) = timed(lambda: s3t.load(STEP))
    out(s=took, bytes=sum(len(d) for d in data.values()))
elif mode == "boto":
    from boto3.s3.transfer import TransferConfig
    tc = TransferConfig(multipart_threshold=settings.get_part_size,
                        multipart_chunksize=settings.get_part_size,
                        max_concurrency=settings.get_concurrency, use_threads=True)
    m = s3t.manifest(STEP)  # the shards' names: not timed (S3Tier.load's time includes it)
    where = f"{SHM}-boto/{job}"
    os.makedirs(where, exist_ok=True)
    try:
        def download():
            for sh in m.shards:
                s3.download_file(c.s3_bucket, f"{s3t.base}/{step_dir(STEP)}/{sh.name}",
                                 f"{where}/{sh.name}", Config=tc)
        took, _ = timed(download)
        got = sum(os.path.getsize(f"{where}/{sh.name}") for sh in m.shards)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if got != m.total_bytes:
        sys.exit(f"boto3 downloaded {got} bytes of {m.total_bytes}")
    out(s=took, bytes=got)
elif mode == "clean":
    s3t.delete(STEP)
    shutil.rmtree(f"{SHM}/{job}", ignore_errors=True)
    out(cleaned=job)
else:
    sys.exit(f"unknown mode {mode}")
'''


def inside(cluster: Cluster, mode: str, *args: str, env: Mapping[str, str] | None = None,
           timeout: float = INSIDE_TIMEOUT_S) -> dict[str, Any]:
    """One run of _INSIDE in node c1 as root (the installed gpuwarden, its interpreter)."""
    environment = {"GPUWARDEN_BENCH_CONFIG": CONFIG, "GPUWARDEN_BENCH_SHM": BENCH_SHM, **(env or {})}
    res = run_in(cluster.container(NODE), [VENV_PYTHON, "-I", "-c", _INSIDE, mode, *args],
                 timeout=timeout, environment=environment)
    lines = res.out.strip().splitlines()
    if res.rc != 0 or not lines:
        tail = "\n".join((res.err.strip() or res.out.strip()).splitlines()[-8:])
        raise NoResult(f"{NODE}: {mode} {' '.join(args)} failed (exit {res.rc}):\n{tail}")
    return json.loads(lines[-1])  # type: ignore[no-any-return]


# ---- the cluster -------------------------------------------------------------------------------
class S3Link:
    """The S3 link's shaping (devcluster.s3shape), by `docker exec` in the s3 container."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.how: s3shape.Shape | None = None

    def run(self, host: str, argv: list[str]) -> tuple[int, str]:
        got = self.cluster.exec(host, argv, timeout=30)
        return got.rc, got.out + got.err

    def shape(self, how: s3shape.Shape) -> None:
        self.how = how
        s3shape.shape(self.run, how)

    def reshape(self, host: str) -> None:
        """A node that came back: the shaping is in the s3 container and outlives the node's
        restart; this checks the relay still runs as asked (restarted if not)."""
        if self.how is not None:
            s3shape.shape(self.run, self.how)

    def unshape(self) -> None:
        self.how = None
        s3shape.unshape(self.run)


def up_command(spec: Spec) -> str:
    return (f"GPUWARDEN_CLUSTER_NAME={spec.name} GPUWARDEN_SITE=objstore "
            ".venv/bin/python -m devcluster up")


def check_up(cluster: Cluster, spec: Spec) -> None:
    """Every container of the cluster is there and running, Slurm and S3 answer."""
    for host in [*spec.services, *spec.node_names]:
        try:
            status = cluster.container(host).status
        except Exception:  # docker.errors.NotFound, and nothing else worth telling apart
            status = "missing"
        if status != "running":
            raise NoResult(f"cluster {spec.name} is not up (container {spec.container_name(host)} "
                           f"is {status}): start it with `{up_command(spec)}`")
    try:
        cluster.wait_ready(timeout=120)
    except GpuwardenError as exc:
        raise NoResult(f"cluster {spec.name} is not ready: {exc}") from None


def check_site(info: Mapping[str, Any], spec: Spec) -> None:
    """The running cluster's config (c1's) is an objstore site's."""
    wrong = [what for what, bad in (
        ("it has [ckpt] shared_root", bool(info["shared_root"])),
        ("it has no [ckpt] key_file", not info["key_file"]),
        ("it has no [ckpt] s3_bucket", not info["bucket"]),
        ("it has no [ckpt] stage_in_s3_env", not info["stage_in_s3_env"]),
        (f"{NODE} has a /fsx", bool(info["fsx"]))) if bad]
    if wrong:
        raise NoResult(f"cluster {spec.name} is not of the objstore site ({'; '.join(wrong)}): "
                       f"bring one up with `{up_command(spec)}`")


class Say:
    """Progress lines on stderr, each with the time since the start."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def wait_for(cond: Callable[[], bool], timeout: float, what: str, say: Callable[[str], None],
             status: Callable[[], str] = lambda: "", poll_s: float = 1.0) -> None:
    """Poll ``cond`` until it holds; a progress line every 15 s; NoResult past ``timeout``."""
    start = time.monotonic()
    told = start
    while not cond():
        now = time.monotonic()
        if now - start > timeout:
            last = status()
            raise NoResult(f"timed out after {timeout:.0f} s waiting for {what}"
                           + (f" ({last})" if last else ""))
        if now - told >= 15:
            told, last = now, status()
            say(f"waiting for {what}, {now - start:.0f} s" + (f": {last}" if last else ""))
        time.sleep(poll_s)


# ---- ratios 1 and 2 ------------------------------------------------------------------------------
def restore_and_download(cluster: Cluster, mb: int, repeat: int,
                         say: Callable[[str], None]) -> list[Verdict]:
    job = f"bench-objstore-{int(time.time())}"
    env = {"GPUWARDEN_BENCH_JOB": job, "GPUWARDEN_BENCH_KEY": secrets.token_hex(32)}
    say(f"writing {mb} MiB ({SHARDS} shards) to tier 0 and S3 as {job} on {NODE}")
    try:
        put = inside(cluster, "put", str(mb), str(SHARDS), env=env)
        say(f"written; the S3 upload took {put['upload_s']:.2f} s")
        times: dict[str, list[float]] = {"t0": [], "s3": [], "ours": [], "boto": []}
        names = {"t0": "tier-0 restore", "s3": "S3 restore", "ours": "gpuwarden S3Tier.load",
                 "boto": "boto3 download_file"}
        for pair in (("t0", "s3"), ("ours", "boto")):
            for run in range(repeat):
                for arm in interleaved(run, pair):
                    got = inside(cluster, arm, env=env)
                    times[arm].append(float(got["s"]))
                    say(f"{names[arm]}, run {run + 1} of {repeat}: {got['s']:.3f} s")
    finally:
        with contextlib.suppress(NoResult):
            inside(cluster, "clean", env=env, timeout=120)
    med = {arm: statistics.median(t) for arm, t in times.items()}
    return [
        Verdict(f"1. S3 restore / tier-0 restore (read, verify, decode {mb} MiB, {NODE})",
                ratio(med["s3"], med["t0"], "tier-0 restore"), ">=", RESTORE_GOAL,
                f"S3 {seconds(times['s3'])}; tier 0 {seconds(times['t0'])}"),
        Verdict(f"2. boto3 download_file / gpuwarden S3Tier.load ({mb} MiB, same objects)",
                ratio(med["boto"], med["ours"], "S3Tier.load"), ">=", DOWNLOAD_GOAL,
                f"boto3 {seconds(times['boto'])}; gpuwarden {seconds(times['ours'])}"),
    ]


# ---- ratio 3 -------------------------------------------------------------------------------------
def submit(h: Harness, script: str, nodes: int, env: Mapping[str, str], args: Sequence[str]) -> int:
    """sbatch as the user, ``env`` (S3 credentials among it) in sbatch's own environment, which
    the job inherits: given to `docker exec`, never on a command line (where `ps` and an error
    message would show it)."""
    gpus = h.cluster.spec.cluster.gpus_per_node
    argv = ["sbatch", "--parsable", "--job-name=train", f"--chdir={LOCAL_JOBS_DIR}",
            f"--output={LOCAL_JOBS_DIR}/%x-%j.out", f"-N{nodes}", f"--gpus-per-node={gpus}",
            script, *args]
    res = run_in(h.container("slurmctld"), argv, timeout=30, user=USER, environment=dict(env))
    if res.rc != 0 or not res.out.strip().split(";")[0].isdigit():
        raise NoResult(f"sbatch {script} failed (exit {res.rc}): {res.err.strip()[-500:]}")
    return int(res.out.strip().split(";")[0])


def output(h: Harness, host: str, job: int) -> str:
    """The job's output file on ``host`` (its batch host's), "" when it cannot be read (not
    there yet, or the host is down)."""
    try:
        return h.exec(host, ["cat", f"{LOCAL_JOBS_DIR}/train-{job}.out"], timeout=20).out
    except Exception:  # a container that is not running: nothing to read there
        return ""


def state(h: Harness, job: int) -> str:
    got = h.job(job)
    return got.state[0] if got and got.state else ""


def node_down(h: Harness, host: str) -> bool:
    res = h.exec("slurmctld", ["scontrol", "show", "node", host, "--json"], timeout=20)
    nodes = parse.parse_nodes(res.out) if res.rc == 0 else []
    return not nodes or nodes[0].down


def quietly(what: str, fn: Callable[[], object]) -> None:
    """Clean-up that must not hide the run's own error."""
    try:
        fn()
    except Exception as exc:
        print(f"objstore benchmark: WARNING: {what}: {exc}", file=sys.stderr, flush=True)


def recovery_arm(h: Harness, link: S3Link, arm: str, script: str, nodes: int,
                 env: Mapping[str, str], args: Sequence[str], say: Callable[[str], None]) -> float:
    """Seconds from the kill of a training node to every rank's "restored step" line."""
    job = submit(h, script, nodes, env, args)
    say(f"{arm} arm: job {job} submitted ({script.rsplit('/', 1)[-1]}, {nodes} nodes)")
    victim = ""
    took = 0.0
    try:
        def running() -> bool:
            now = state(h, job)
            if now in TERMINAL:
                raise NoResult(f"{arm} arm: job {job} ended {now} before it trained")
            return now == "RUNNING"
        wait_for(running, 300, f"job {job} running", say, lambda: job_status(job, h.job(job)))
        held: dict[str, Any] = {}

        def in_index() -> bool:
            now = state(h, job)
            if now in TERMINAL:
                raise NoResult(f"{arm} arm: job {job} ended {now} before step {KILL_AT}")
            got = inside(h.cluster, "index", str(job), USER, str(RANKS), timeout=60)
            if got != held:
                held.update(got)
                say(f"{arm} arm: job {job}'s S3 index: {got['ranks']} of {RANKS} ranks, newest "
                    f"step all hold: {got['step']}")
            return got["step"] is not None and got["step"] >= KILL_AT
        wait_for(in_index, 300, f"step {KILL_AT} of every rank of job {job} in S3's index", say)
        fields = h.job_fields(job)
        allocated = h.exec("slurmctld", ["scontrol", "show", "hostnames", fields["NodeList"]]
                           ).check("scontrol show hostnames").out.split()
        batch = fields.get("BatchHost", "")
        # Not the first node: the batch script (the launcher, the coordinator) runs there, and
        # losing it is the requeue path's case; the second trains in both arms (spares last).
        victim = allocated[1]
        if victim == batch:
            raise NoResult(f"{arm} arm: job {job}'s second node {victim} is its batch host")
        before = {batch: len(output(h, batch, job))}
        say(f"{arm} arm: killing {victim} (job {job} on {','.join(allocated)})")
        killed = time.monotonic()
        h.kill(victim)

        def restored() -> bool:
            host = h.job_fields(job).get("BatchHost", "")  # a requeued job's may be another
            if host not in h.cluster.spec.node_names or host == victim:
                return False
            return restored_ranks(output(h, host, job)[before.get(host, 0):]) >= set(range(RANKS))
        wait_for(restored, 600, f"every rank of job {job} restored", say,
                 lambda: job_status(job, h.job(job)), poll_s=POLL_S)
        took = time.monotonic() - killed
        say(f"{arm} arm: every rank restored {took:.1f} s after the kill")
    finally:
        # The measurement is done: the rest of the training is not needed.
        quietly(f"scancel {job}", lambda: h.exec("slurmctld", ["scancel", str(job)]))
        quietly(f"job {job} to end", lambda: h.wait_job(job, want=TERMINAL, timeout=180))
        if victim:
            quietly(f"heal {victim}", lambda: h.heal(victim))
    if victim:
        wait_for(lambda: not node_down(h, victim), 240, f"{victim} back in service", say)
        link.reshape(victim)
        say(f"{victim} back in service" + (", its S3 link shaped again" if link.how else ""))
    return took


def recovery(h: Harness, link: S3Link, rank_mb: int, say: Callable[[str], None]) -> Verdict:
    # The jobs' S3 credentials, as a user would have them: in their environment.
    text = h.exec(NODE, ["cat", "/etc/gpuwarden-cluster/s3.env"]).check("read s3.env").out
    creds = {k: v for k, _, v in (line.partition("=") for line in text.splitlines())
             if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    if len(creds) != 2:
        raise NoResult("the cluster's s3.env has no AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    h.prepare_jobs_dir()
    args = ["--steps", "300", "--every", "5", "--mb", str(rank_mb)]
    spare = recovery_arm(h, link, "spare", SPARES_SBATCH, RANKS + 1,
                         {**creds, "SPARES": "1", "LAUNCH_OPTS": "--deadline-s 5"}, args, say)
    requeue = recovery_arm(h, link, "requeue", TRAIN_SBATCH, RANKS, creds, args, say)
    return Verdict(
        f"3. spare recovery / requeue-from-S3 recovery ({RANKS} ranks of {rank_mb} MiB, node "
        f"killed once step {KILL_AT} is in S3's index)",
        ratio(spare, requeue, "the requeue arm"), "<=", RECOVERY_GOAL,
        f"spare {spare:.1f} s; requeue {requeue:.1f} s (kill to every rank restored, polled "
        f"every {POLL_S:g} s; the test cluster's requeue hold is 31 s, Slurm's default 121 s)")


# ---- the run -----------------------------------------------------------------------------------
def run(args: argparse.Namespace, spec: Spec, say: Say) -> int:
    try:
        import docker  # noqa: PLC0415 - `--help` and the refusals need no docker

        client = docker.from_env(timeout=600)
        client.ping()
    except Exception as exc:
        raise NoResult(f"cannot reach the Docker daemon ({exc})") from None
    cluster = Cluster(client, spec, progress=say)
    check_up(cluster, spec)
    if not args.skip_recovery and len(spec.node_names) < RANKS + 1:
        raise NoResult(f"the recovery arm needs {RANKS + 1} nodes, the cluster has "
                       f"{len(spec.node_names)} (or --skip-recovery)")
    info = inside(cluster, "info", timeout=60)
    check_site(info, spec)
    # Tier 0's copy and boto3's download lie in /dev/shm together.
    if info["shm_free_mb"] < 2 * args.mb + 16:
        raise NoResult(f"{NODE}'s /dev/shm has {info['shm_free_mb']} MiB free; --mb {args.mb} "
                       f"needs {2 * args.mb + 16} (tier 0's copy and boto3's download): a "
                       "smaller --mb")
    h = Harness(cluster)
    link = S3Link(cluster)
    verdicts: list[Verdict] = []
    with shaped(link, args.shape, say):
        probe = inside(cluster, "probe", str(PROBE_GETS),
                       env={"GPUWARDEN_BENCH_JOB": f"bench-probe-{int(time.time())}",
                            "GPUWARDEN_BENCH_KEY": secrets.token_hex(32)}, timeout=120)
        rtt = statistics.median(probe["ms"])
        how = args.shape
        link_text = ("unshaped" if how is None else
                     f"shaped {how.delay} each way, {how.rate} (downloads shared by every node, "
                     "uploads per node)")
        if how is not None and not shaping_seen(rtt, how):
            raise NoResult(f"the S3 link is not shaped as asked: a round trip took {rtt:.1f} ms, "
                           f"under twice the {how.delay} delay (is another tool resetting tc?)")
        print(f"objstore benchmark: cluster {spec.name} (objstore site, "
              f"{len(spec.node_names)} nodes), node {NODE}")
        print(f"S3 link {link_text}; probe RTT from {NODE}: {rtt:.1f} ms (median of {PROBE_GETS} "
              "GETs of 1 byte, connection warm)")
        print(f"ratios 1-2: {args.mb} MiB in {SHARDS} shards; the tier's ranged GETs of "
              f"{info['get_part_mb']} MiB, {info['get_concurrency']} at once (boto3 the same); "
              f"{args.repeat} runs of each, interleaved, medians compared", flush=True)
        for v in restore_and_download(cluster, args.mb, args.repeat, say):
            verdicts.append(v)
            print(v.line(), flush=True)
        if args.skip_recovery:
            say("recovery arm skipped (--skip-recovery)")
        else:
            v = recovery(h, link, args.rank_mb, say)
            verdicts.append(v)
            print(v.line(), flush=True)
    print(summary(verdicts))
    return exit_code(verdicts)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        spec = from_env()
    except GpuwardenError as exc:
        print(f"objstore benchmark: {exc}", file=sys.stderr)
        return EXIT_NO_VERDICT
    if spec.site != "objstore":
        print(f"objstore benchmark: GPUWARDEN_SITE is {spec.site!r}: this benchmark runs on a "
              "cluster of the objstore site; set GPUWARDEN_SITE=objstore and the "
              "GPUWARDEN_CLUSTER_NAME it was brought up with (`GPUWARDEN_CLUSTER_NAME=gwobj "
              "GPUWARDEN_SITE=objstore .venv/bin/python -m devcluster up`)", file=sys.stderr)
        return EXIT_NO_VERDICT
    say = Say()
    try:
        return run(args, spec, say)
    except (NoResult, s3shape.ShapeError) as exc:
        print(f"objstore benchmark: no verdict: {exc}", file=sys.stderr)
    except Exception:
        traceback.print_exc()
        print("objstore benchmark: no verdict: the run failed (above)", file=sys.stderr)
    return EXIT_NO_VERDICT


if __name__ == "__main__":
    sys.exit(main())
