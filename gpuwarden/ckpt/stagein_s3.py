"""Prolog stage-in from S3, on a site without a shared tier (issue 37; docs/design/
object-store-sites.md 4.2). `stagein` runs it: root's part before the fork, the user's after.

Root's part (`with_secrets`): the job's keys derived from the site secret (`jobkey`), and the
optional credentials file ``[ckpt] stage_in_s3_env`` (``KEY=VALUE`` lines, root's alone) read.
Both reach the child in memory (the forked `stagein.Request`), never in its argv or environment,
and are never logged: the keys show as key ids and fingerprints, the credentials not at all.

The user's part (`plan`, in the child that has become the job's user): one paginated LIST of the
job's authenticated index (`s3index`), read up to `MAX_INDEX_NAMES` names (a user flooding the
prefix can make stage-in give up, never make the prolog slow); the newest step every rank holds;
this node's ranks' manifests, MAC first (`S3Tier.read_manifest`: the MAC also authenticates the
shards' keyed digests); a rank of this node failing walks back to the next step every rank
holds, at most `MAX_TRIED` steps. The shards are then fetched by `stagecopy.S3StageSource`
(ranged GETs, each shard's keyed digest and checksum verified as it lands) and committed into
tier 0 as the shared tier's are. Whatever goes wrong is logged; the job restores from S3 itself.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gpuwarden.ckpt import jobkey
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.s3index import INDEX, Index
from gpuwarden.ckpt.s3tier import S3Settings, S3Step, S3Tier, client
from gpuwarden.ckpt.stagecopy import S3StageSource
from gpuwarden.ckpt.stagein import NOTHING, Plan, Request, select
from gpuwarden.ckpt.tier import CorruptStep, TierError
from gpuwarden.core import safefs
from gpuwarden.core.errors import GpuwardenError

if TYPE_CHECKING:
    from gpuwarden.config.ckpt import CkptConfig

log = logging.getLogger(__name__)

# Index names read at most: 1024 ranks keeping 2 steps (and one in flight) are about 3,000; a
# page of LIST is 1,000 names, so this is at most 100 pages (seconds, against a 120 s budget).
MAX_INDEX_NAMES = 100_000
MAX_TRIED = 3  # steps tried, newest first, before giving up
PROLOG_CONCURRENCY = 8  # ranged GETs at once: at most 8 x s3_get_part_mb (<= 64) in memory
_ORPHAN_S = 10.0  # past the budget: the parent kills the copy first; this bounds an orphan

# ``stage_in_s3_env``: the names boto3 itself reads from an environment, as client arguments.
ENV_KEYS = {
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
    "AWS_DEFAULT_REGION": "region_name",
    "AWS_REGION": "region_name",
}
MAX_ENV_FILE = 16 << 10
_ENV_LINE = re.compile(r"([A-Z_][A-Z0-9_]{0,63})=(.*)")


class SetupError(GpuwardenError):
    """Root cannot prepare an S3 stage-in (the key or the credentials file); the message says
    why, never a secret."""


# ---- root's part, before the fork ----------------------------------------------------------------
def read_env_file(path: str) -> dict[str, str]:
    """``path``'s ``KEY=VALUE`` lines as boto3.client arguments: only a regular file of root's
    that nobody else can read or write, in a directory nobody else can write, reached without a
    link (`safefs.admin_file_problem`, then by descriptor); only the names of `ENV_KEYS`.
    SetupError naming the file, line and key, never a value."""
    what = f"stage_in_s3_env {path}"
    problem = safefs.admin_file_problem(path)
    if problem:
        raise SetupError(f"{what}: {problem}: refused")
    try:
        data = jobkey.read_root_file(path, MAX_ENV_FILE, "stage_in_s3_env ",
                                     "chown root, chmod 600")
    except jobkey.JobKeyError as exc:
        raise SetupError(str(exc)) from None
    return _parse_env(data, what)


def _parse_env(data: bytes, what: str) -> dict[str, str]:
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise SetupError(f"{what}: not ASCII text: refused") from None
    out: dict[str, str] = {}
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _ENV_LINE.fullmatch(line)
        if m is None:
            raise SetupError(f"{what} line {n}: expected KEY=VALUE: refused")
        key, value = m.group(1), m.group(2).strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if key not in ENV_KEYS:
            raise SetupError(f"{what} line {n}: {key} is not one of {', '.join(ENV_KEYS)}: "
                             "refused")
        arg = ENV_KEYS[key]
        if not value or arg in out:
            raise SetupError(f"{what} line {n}: {key} is empty or given twice: refused")
        out[arg] = value
    return out


def with_secrets(cfg: CkptConfig, req: Request, cluster: str) -> Request:
    """``req`` with the job's keys (derived from ``[ckpt] key_file``, as the prolog's
    `jobkey.for_prolog` derives them) and the credentials of ``stage_in_s3_env``. Root's, in
    this process, before the fork: the child gets them in memory only. SetupError."""
    if req.s3 is None:
        raise SetupError("no S3 settings")
    if not cfg.key_file:
        raise SetupError("[ckpt] key_file is not set: no job key to authenticate S3 steps with")
    try:
        site = jobkey.load_site_keys(cfg.key_file)
        keys = jobkey.JobKeys.of(jobkey.derive(site, cluster, req.job_id, req.uid))
    except jobkey.JobKeyError as exc:
        raise SetupError(str(exc)) from None
    credentials = read_env_file(cfg.stage_in_s3_env) if cfg.stage_in_s3_env else {}
    log.debug("stage-in job %s: S3 with job key %r, %s", req.job_id, keys,
              "the credentials of stage_in_s3_env" if credentials else "boto3's default chain")
    return replace(req, keys=keys, s3=replace(req.s3, credentials=credentials))


# ---- the user's part, in the child ---------------------------------------------------------------
def make_client(settings: S3Settings, credentials: Mapping[str, str]) -> Any:
    """The child's S3 client: boto3's default chain (an instance role), or ``credentials``.

    The child is the job's user, and Slurm gives the prolog no HOME: botocore would read that
    user's ~/.aws/config, credentials and models, and an endpoint_url or ca_bundle there would
    steer the client that carries root's stage-in credentials to the user. So its session
    reads no file of anyone's (config and credentials files /dev/null, no extra data path,
    HOME=/ for the models it searches by default)."""
    import boto3  # noqa: PLC0415 - the child has it loaded already (stage_in imports us)
    import botocore.session  # noqa: PLC0415

    os.environ["HOME"] = "/"
    core = botocore.session.Session()
    for name, value in (("config_file", os.devnull), ("credentials_file", os.devnull),
                        ("data_path", "")):
        core.set_config_variable(name, value)
    return client(settings, credentials, session=boto3.session.Session(botocore_session=core))


def _settings(req: Request) -> S3Settings:
    assert req.s3 is not None
    s = req.s3
    return S3Settings(s.bucket, s.prefix, s.endpoint or None, get_part_size=s.get_part_mb << 20,
                      get_concurrency=min(s.get_concurrency, PROLOG_CONCURRENCY),
                      legacy_steps=s.legacy_steps)


def _list(s3: Any, settings: S3Settings, req: Request) -> tuple[Index, int, bool]:
    """The job's index from one paginated LIST, at most `MAX_INDEX_NAMES` names read: (index,
    names read, whether there were more)."""
    base = f"{settings.prefix}/{req.job}/{INDEX}/"
    names: list[str] = []
    more = False
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=settings.bucket, Prefix=base)
    for page in pages:
        for obj in page.get("Contents", []):
            if len(names) >= MAX_INDEX_NAMES:
                more = True
                break
            names.append(str(obj["Key"])[len(base):])
        if more:
            break  # the pages after it are never asked for
    return Index.read(names, req.keys, req.job), len(names), more


Verified = tuple[S3Tier, S3Step]


def _verify(req: Request, s3: Any, settings: S3Settings, step: int, world: int,
            ranks: range) -> tuple[dict[int, Verified], list[int], list[int]] | None:
    """This node's ranks at ``step``: (to fetch, verified; already in tier 0; tier 0 unfit).
    None when a rank's step in S3 is not authentic or not whole (logged): walk back."""
    todo: dict[int, Verified] = {}
    there: list[int] = []
    unfit: list[int] = []
    for r in ranks:
        try:
            if step in FsTier("memory", req.memory_root, req.job, r).steps():
                there.append(r)
                continue
        except TierError as exc:
            log.warning("stage-in job %s: rank %d: tier 0: %s", req.job_id, r, exc)
            unfit.append(r)
            continue
        tier = S3Tier("s3", settings, req.job, r, s3=s3, keys=req.keys)
        try:
            got = tier.read_manifest(step)
            if got.manifest.world_size != world:
                raise CorruptStep(f"a step of {got.manifest.world_size} ranks, the index says "
                                  f"{world}")
        except (CorruptStep, TierError) as exc:
            log.warning("stage-in job %s: rank %d step %d in S3 refused: %s", req.job_id, r,
                        step, exc)
            return None
        todo[r] = (tier, got)
    return todo, there, unfit


def plan(req: Request) -> Plan | int:
    """What to fetch: this node's ranks of the newest step every rank holds in the index whose
    manifests verify; NOTHING (nothing to stage) or 1 (failed, logged) otherwise."""
    assert req.s3 is not None
    settings = _settings(req)
    origin = req.origin
    try:
        s3 = make_client(settings, req.s3.credentials)
        index, read, more = _list(s3, settings, req)
    except Exception as exc:  # boto3's own errors, a credentials chain that fails: logged
        log.warning("stage-in job %s: cannot list %s/%s/%s/ (%s): the job restores from S3 "
                    "itself", req.job_id, origin, req.job, INDEX, exc)
        return 1
    if more:
        log.warning("stage-in job %s: the index %s/%s/%s/ has more names than stage-in reads: "
                    "stopped after %d names (MAX_INDEX_NAMES; is someone flooding the prefix?); "
                    "using what was read", req.job_id, origin, req.job, INDEX, read)
    if index.refused:
        log.warning("stage-in job %s: %d index names refused (not made with this job's key)",
                    req.job_id, index.refused)
    newest = index.newest()
    if newest is None:
        log.info("stage-in job %s: no step is held by every rank in %s: nothing to stage",
                 req.job_id, origin)
        return NOTHING
    world = newest[1]
    sel = select(index.held(world), world, req.nodes, req.node)
    if sel.why:
        log.warning("stage-in job %s: skipped: %s", req.job_id, sel.why)
        return NOTHING
    tried = index.complete(world)[:MAX_TRIED]
    deadline = time.monotonic() + req.budget_s + _ORPHAN_S
    for i, step in enumerate(tried):
        got = _verify(req, s3, settings, step, world, sel.ranks)
        if got is None:
            if i + 1 < len(tried):
                log.warning("stage-in job %s: walking back from step %d to step %d",
                            req.job_id, step, tried[i + 1])
            continue
        todo, there, unfit = got

        def source(r: int, step: int = step, todo: dict[int, Verified] = todo) -> S3StageSource:
            tier, got = todo[r]
            return S3StageSource(tier, step, got, concurrency=settings.get_concurrency,
                                 deadline=deadline)

        return Plan(step, world, sel.ranks,
                    {r: v[1].manifest.total_bytes for r, v in todo.items()},
                    source, len(there), len(unfit))
    log.warning("stage-in job %s: gave up after %d steps (%s): none of them verified for ranks "
                "%s in %s; the job restores from S3 itself", req.job_id, len(tried),
                ", ".join(map(str, tried)), f"{sel.ranks[0]}-{sel.ranks[-1]}", origin)
    return 1
