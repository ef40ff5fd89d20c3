"""`gpuwarden ckpt ls|verify|gc|tidy|interval|coord`."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import click

from gpuwarden.accounting.options import load_history, parse_cost, since_option
from gpuwarden.ckpt import jobkey
from gpuwarden.ckpt.jobkey import JobKeys
from gpuwarden.ckpt.names import BadName, check_name
from gpuwarden.config.context import Context
from gpuwarden.core.errors import GpuwardenError
from gpuwarden.core.extras import Needs
from gpuwarden.slurm.jobuid import MAX_UID

# numpy and xxhash: the base install still lists and explains these commands (--help).
with Needs("ckpt") as CKPT:
    from gpuwarden.ckpt.build import tiers
    from gpuwarden.ckpt.fstier import ANY_JOB_USER, FsTier
    from gpuwarden.ckpt.retention import to_delete
    from gpuwarden.ckpt.tier import CorruptStep, TierError
# `interval` reads the MTTF from accounting as `fleet mttf` does (numpy, not xxhash).
with Needs("lemon") as MTTF:
    from gpuwarden.accounting.mttf import daly, human_hours, young


def _tiers_or_exit(obj: Context, job: str, rank: int, uid: int | None) -> list[Any]:
    # Root looks at any user's job: the job directory's owner is taken as the job's user and
    # everything below must be that user's; nothing is followed through a link, nor read
    # unless it is a regular file (fstier, safeio).
    root = os.geteuid() == 0
    owner = ANY_JOB_USER if root else None
    config = obj.config_or_exit()
    cfg = config.ckpt
    _check_uid(cfg, root, uid)
    try:
        check_name(job, "job")
        return tiers(cfg, job, rank, owner, s3_keys=_s3_keys(config, job, root, uid))
    except BadName as exc:
        raise click.ClickException(str(exc)) from None


def _check_uid(cfg: Any, root: bool, uid: int | None) -> None:
    """--uid only where it is used: root deriving a job's keys for S3."""
    why = ("" if uid is None else
           "only root derives a job's keys; the job's user runs this on a node of the job"
           if not root else
           "[ckpt] key_file is not set: this site derives no job keys" if not cfg.key_file else
           "[ckpt] s3_bucket is not set: no S3 steps to authenticate" if not cfg.s3_bucket
           else "")
    if why:
        raise click.UsageError(f"--uid: {why}")


def _s3_keys(config: Any, job: str, root: bool, uid: int | None) -> JobKeys | None:
    """The keys the job signs its S3 steps with, to authenticate them here: on a site with
    ``key_file``, derived from the site secret (root) or the prolog's key file (the job's
    user, on a node of the job), with the shared tier's ``peer.key`` where there is one (what
    the job signed before the site set key_file); else that ``peer.key``. None (S3 steps are
    then refused, and said so) when none can be had."""
    cfg = config.ckpt
    if not cfg.s3_bucket:
        return None
    # Where key_file is set a job has no peer.key unless it ran before: nothing to say then.
    shared = _shared_key(cfg, job, root, quiet=bool(cfg.key_file))
    derived = None
    if cfg.key_file:
        derived = _derived(config, job, uid) if root else _key_file(cfg, job)
    if derived is None:
        return None if shared is None else JobKeys.shared(shared)
    return derived if shared is None else derived.with_shared(shared)


def _shared_key(cfg: Any, job: str, root: bool, quiet: bool) -> bytes | None:
    """The job's ``peer.key`` from the shared tier; None (said unless ``quiet``) when it
    cannot be read."""
    if not cfg.shared_root:
        return None
    from gpuwarden.ckpt.peer import read_job_key  # noqa: PLC0415 - S3 only
    from gpuwarden.ckpt.peerwire import PeerError  # noqa: PLC0415

    try:
        return read_job_key(cfg.shared_root, job, None if root else os.geteuid())
    except PeerError as exc:
        if not quiet:
            _unauthenticated(str(exc))
        return None


def _unauthenticated(why: str) -> None:
    click.echo(f"s3       steps cannot be authenticated: {why}", err=True)


def _job_id(job: str) -> str | None:
    """N of ``job-N``, the Slurm job id a job's keys are derived for; None (and said) for any
    other name."""
    from gpuwarden.slurm import jobenv  # noqa: PLC0415

    job_id = job.removeprefix("job-")
    if job_id == job or not jobenv.digits(job_id, jobenv.JOB_ID_DIGITS):
        _unauthenticated(f"{job} is not job-<Slurm job id>, which its keys are made for")
        return None
    return job_id


def _derived(config: Any, job: str, uid: int | None) -> JobKeys | None:
    """Root's: the job's keys derived from the site secret for the uid it ran as (``uid``,
    else Slurm's), as its prolog derived them. ClickException when no uid can be had."""
    from gpuwarden.slurm import jobuid  # noqa: PLC0415 - root's, on key_file sites only

    job_id = _job_id(job)
    if job_id is None:
        return None
    try:  # first: without a secret to derive from, Slurm need not be asked
        site = jobkey.load_site_keys(config.ckpt.key_file)
    except jobkey.JobKeyError as exc:
        _unauthenticated(f"{exc} (root derives the job's keys from the site secret, [ckpt] "
                         "key_file: run this where it can be read)")
        return None
    source = "--uid"
    if uid is None:
        found = jobuid.lookup(job_id, config.slurm)
        if found.uid is None:
            raise click.ClickException(
                f"job {job_id}'s S3 steps are signed with keys derived for the uid it ran as, "
                f"and Slurm does not say which ({found.why}): give it with --uid N")
        uid, source = found.uid, found.source
    try:
        keys = JobKeys.of(jobkey.derive(site, config.cluster.name, job_id, uid))
    except jobkey.JobKeyError as exc:
        _unauthenticated(str(exc))
        return None
    # Key ids and fingerprints only (never a key): a fingerprint that differs from the
    # prolog's log for this job means another uid, [cluster] name or site file.
    click.echo(f"s3       keys derived for uid {uid} ({source}), cluster "
               f"{config.cluster.name}: {keys!r}", err=True)
    return keys


def _key_file(cfg: Any, job: str) -> JobKeys | None:
    """The job's user's: the prolog's key file on this node (a node of the job); None, and
    where the steps can be authenticated instead, when there is none."""
    job_id = _job_id(job)
    if job_id is None:
        return None
    try:
        return jobkey.read_job_keys(cfg.job_key_dir, job_id)
    except jobkey.JobKeyError as exc:
        command = click.get_current_context().info_name
        click.echo(f"s3       S3 steps cannot be authenticated on this host: {exc}. They can "
                   f"be on a node of job {job_id} while it runs there (the prolog's key file), "
                   f"or by root where the site secret ([ckpt] key_file) is: `gpuwarden ckpt "
                   f"{command} {job}` as root (with --uid N once Slurm no longer knows the "
                   "job)", err=True)
        return None


@click.group("ckpt")
def ckpt() -> None:
    """Tiered checkpoints: list, verify, clean up, and the interval to take them at."""


def _listed(tiers_: list[Any]) -> Iterator[tuple[Any, list[int]]]:
    """Each tier with its steps; a tier that cannot be listed is reported and skipped."""
    for t in tiers_:
        try:
            yield t, t.steps()
        except TierError as exc:
            click.echo(f"{t.name:<8} unavailable: {exc}")


_uid_option = click.option(
    "--uid", type=click.IntRange(0, MAX_UID), default=None,
    help="root, where [ckpt] key_file is set: the uid the job ran as, whose keys (derived "
         "from the site secret) authenticate its S3 steps  [default: Slurm's]")


def _job_tiers(fn: Callable[..., None]) -> Callable[..., None]:
    """The JOB argument and --rank option, handed to the command as that rank's tiers."""
    def command(obj: Context, /, job: str, rank: int, uid: int | None, **options: Any) -> None:
        tiers_ = _tiers_or_exit(obj, job, rank, uid)
        # One rank's steps, this host's memory: say so, or they read as the whole job's.
        host = os.uname().nodename.split(".")[0]
        click.echo(f"{job} rank {rank}, memory tier on {host} (this host); --rank N for "
                   f"another rank, `gpuwarden ckpt ls {job}` lists every rank")
        fn(obj, tiers_, **options)
    command.__name__, command.__doc__ = fn.__name__, fn.__doc__
    command.__dict__.update(fn.__dict__)  # the command's own options (click keeps them there)
    with_obj = click.pass_obj(command)
    rank = click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True)
    return click.argument("job")(rank(_uid_option(with_obj)))


@ckpt.command("ls")
@CKPT.required
@click.argument("job")
@click.option("--rank", type=click.IntRange(min=0), default=None,
              help="this rank only  [default: every rank]")
@click.option("--json", "as_json", is_flag=True, help="one object per tier and rank")
@_uid_option
@click.pass_obj
def ls(obj: Context, job: str, rank: int | None, as_json: bool, uid: int | None) -> None:
    """Committed steps of JOB, per tier and rank: this host's memory (ranks that ran here),
    the replicas it holds for other ranks (peer), the shared filesystem and S3."""
    import json  # noqa: PLC0415 - the import block above is the extras check's

    from gpuwarden.ckpt import listing  # noqa: PLC0415

    tiers_ = _tiers_or_exit(obj, job, rank or 0, uid)
    rows = list(listing.rows(listing.with_peer(tiers_), rank))
    if rank is None:  # every rank listed: say which old steps other ranks still need
        rows = listing.needed(rows, obj.config_or_exit().ckpt.keep)
    if as_json:
        click.echo(json.dumps([r.to_json() for r in rows], indent=2))
        return
    for line in listing.table(rows, job):
        click.echo(line)


@ckpt.command("verify")
@CKPT.required
@_job_tiers
def verify(obj: Context, tiers_: list[Any]) -> None:
    """Read every step back and check every shard; exit 1 when any copy is corrupt, or is an S3
    step that cannot be authenticated here. Changes nothing."""
    bad = 0
    for t, steps in _listed(tiers_):
        if not steps:
            click.echo(f"{t.name:<8} no steps to verify")
        # Without the job's key an S3 step is anyone's: never "ok", never read (said above).
        keyless = getattr(t, "keys", ()) is None
        for step in steps:
            if keyless:
                bad += 1
                click.echo(f"{t.name:<8} step {step}: NOT AUTHENTICATED: no job key here to "
                           "check it with (S3 cannot tell who wrote it)")
                continue
            try:
                m = t.verify(step)  # streamed: bounded memory whatever the manifest says
                click.echo(f"{t.name:<8} step {step}: ok ({len(m.shards)} shards, "
                           f"{m.total_bytes} bytes)")
            except (CorruptStep, TierError) as exc:
                bad += 1
                click.echo(f"{t.name:<8} step {step}: CORRUPT: {exc}")
    if bad:
        sys.exit(1)


@ckpt.command("gc")
@CKPT.required
@_job_tiers
@click.option("--keep", type=int, default=None, help="steps to keep per tier [config: 2]")
def gc(obj: Context, tiers_: list[Any], keep: int | None) -> None:
    """Apply retention (never a tier's newest step), drop crashed temp files and uploads.
    A step that cannot be read as the job's own is left in place and reported. On the
    shared tier and S3, as the job's own retention does, every step from the one a restart
    restores (the oldest of the ranks' newest) is kept, and nothing is deleted while that
    step cannot be known (a rank with no step there yet)."""
    from gpuwarden.ckpt import listing  # noqa: PLC0415 - the import block above is the extras check's

    keep = keep if keep is not None else obj.config_or_exit().ckpt.keep
    if keep < 1:
        raise click.BadParameter("--keep must be at least 1")
    for t in tiers_:
        held = ""
        try:
            gone, unreadable = to_delete(t, keep)
            if t.name in listing.DURABLE and gone:
                # A rank behind (it died at step 10) needs step 10 from every other rank.
                floor, who = listing.restart_floor(t)
                kept = [s for s in gone if floor is None or s >= floor]
                gone = [s for s in gone if s not in kept]
                if kept:
                    held = (f", kept step(s) {', '.join(map(str, kept))} beyond keep={keep} ("
                            + (f"{who}, which a restart restores)" if floor is not None else
                               f"the step a restart restores is not known: {who})"))
            for s in gone:
                t.delete(s)
            extra = t.gc_temp() if isinstance(t, FsTier) else t.gc_uploads()
        except (TierError, GpuwardenError, OSError) as exc:
            click.echo(f"{t.name:<8} skipped: {exc}")
            continue
        left = f", left unreadable step(s) {', '.join(map(str, unreadable))} in place" \
            if unreadable else ""
        click.echo(f"{t.name:<8} deleted {len(gone)}{held}{left}, removed {extra} leftover(s)")


@ckpt.command("tidy")
@click.option("-v", "--verbose", is_flag=True, help="name every entry kept, and why")
@click.pass_obj
def tidy(obj: Context, verbose: bool) -> None:
    """Remove what no epilog removed (root, on a timer): the shared tier's empty job
    directories of jobs that are over and, where [ckpt] key_file is set, this node's job key
    files of such jobs (run it on every compute node then). The epilog removes both as each
    job ends; this catches what no epilog saw (a job cancelled while requeued, a node that
    died). On the shared tier only a `job-N` the prolog made (a directory, 0700, never a
    link) and that is empty is removed, by rmdir; anything holding a file stays."""
    cfg = obj.config_or_exit()
    c = cfg.ckpt
    if not (c.shared_root or c.key_file):
        raise click.ClickException("nothing to tidy: set [ckpt] shared_root (the shared "
                                   "filesystem's spool) or key_file (docs/checkpointing.md)")
    asked: list[list[Any]] = []

    def jobs() -> list[Any]:  # Slurm asked once for both, and only when something is found
        if not asked:
            asked.append(list(obj.client_for(cfg).jobs()))
        return asked[0]

    failed = [why for why in (_tidy_shared(c.shared_root, jobs, verbose) if c.shared_root else "",
                              _tidy_keys(c.job_key_dir, jobs, verbose) if c.key_file else "")
              if why]
    if failed:
        raise click.ClickException("; ".join(failed))


def _tidy_shared(root: str, jobs: Callable[[], list[Any]], verbose: bool) -> str:
    """The shared tier tidied and said; why it could not be ("" when it was)."""
    from gpuwarden.ckpt import sharedspool  # noqa: PLC0415 - no numpy or xxhash needed

    try:
        got = sharedspool.tidy(root, jobs)
    except FileNotFoundError:
        return (f"{root} is not there: set [ckpt] shared_root to the shared tier's spool, or "
                "make it (admin guide, step 6)")
    except (GpuwardenError, OSError) as exc:
        return f"{root}: {exc}; nothing removed"
    _said(root, "empty job director", ("y", "ies"), got, verbose)
    return ""


def _tidy_keys(key_dir: str, jobs: Callable[[], list[Any]], verbose: bool) -> str:
    """This node's job key files tidied and said; why they could not be ("" when they
    were)."""
    try:
        got = jobkey.tidy(key_dir, jobs)
    except (GpuwardenError, OSError) as exc:
        return f"{key_dir}: {exc}; no key file removed"
    _said(key_dir, "job key file", ("", "s"), got, verbose)
    return ""


def _said(where: str, what: str, plural: tuple[str, str], got: Any, verbose: bool) -> None:
    from gpuwarden.ckpt import sharedspool  # noqa: PLC0415

    shown = ", ".join(got.removed[:20]) + (", ..." if len(got.removed) > 20 else "")
    click.echo(f"{where}: removed {len(got.removed)} {what}"
               f"{plural[0] if len(got.removed) == 1 else plural[1]}"
               + (f" ({shown})" if shown else ""))
    why: dict[str, int] = {}
    for name, reason in got.kept.items():
        if verbose:
            click.echo(f"kept {name}: {reason}")
        kind = sharedspool.kind_of(reason)
        why[kind] = why.get(kind, 0) + 1
    for kind, n in sorted(why.items()):
        click.echo(f"kept {n}: {kind}")


@ckpt.command("coord", context_settings={"allow_interspersed_args": False})
@click.option("--host", default=None, help="this host's name as the ranks reach it "
              "[default: SLURMD_NODENAME, else the host name]")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
@click.pass_obj
def coord(obj: Context, host: str | None, command: tuple[str, ...]) -> None:
    """Run COMMAND (srun ..., gpuwarden launch ...) with the job's checkpoint coordinator
    beside it, on a site without [ckpt] shared_root: the ranks agree on steps through it,
    at the address COMMAND's environment gets (GPUWARDEN_CKPT_COORD). Exits with COMMAND's
    status; passes it SIGTERM, SIGINT, SIGUSR1 and SIGUSR2. With shared_root, or for a job
    of one task, it runs COMMAND in its place: nothing to coordinate. The sbatch templates
    (ckpt/train.sbatch, train_spares.sbatch) run their srun or launcher under it."""
    import socket  # noqa: PLC0415 - the imports of what this command alone needs

    from gpuwarden.slurm import jobenv  # noqa: PLC0415

    cfg = obj.config_or_exit().ckpt
    environ = os.environ
    one_task = jobenv.ntasks(environ) == "1"
    if cfg.shared_root or one_task or not cfg.key_file:
        if not (cfg.shared_root or cfg.key_file or one_task):
            click.echo("gpuwarden: no [ckpt] shared_root nor key_file: no checkpoint "
                       "coordinator (a job of several ranks cannot checkpoint)", err=True)
        _exec(command)
    job_id = jobenv.valid_job_id(environ)
    if not job_id:
        raise click.UsageError("SLURM_JOB_ID is not set: run this in a batch script")
    from gpuwarden.ckpt import coordwrap  # noqa: PLC0415

    try:
        keys = jobkey.read_job_keys(cfg.job_key_dir, job_id)
        rc = coordwrap.serve(command, keys.signing[1], f"job-{job_id}",
                             host or jobenv.node_name(environ, socket.gethostname), environ,
                             say=lambda line: click.echo(line, err=True))
    except OSError as exc:  # COMMAND could not be started
        _not_run(command, exc)
    except GpuwardenError as exc:  # no key file; no port; not reached at --host
        raise click.ClickException(str(exc)) from None
    sys.exit(rc)


def _exec(command: tuple[str, ...]) -> NoReturn:
    """COMMAND in this process's place (its pid, its signals, its status), or exit 127 as a
    shell does when it cannot be run."""
    try:
        os.execvp(command[0], list(command))  # noqa: S606 - the batch script's own command
    except OSError as exc:
        _not_run(command, exc)


def _not_run(command: tuple[str, ...], exc: OSError) -> NoReturn:
    click.echo(f"gpuwarden: cannot run {command[0]!r}: {exc.strerror}", err=True)
    sys.exit(127 if isinstance(exc, FileNotFoundError) else 126)


@ckpt.command("interval")
@MTTF.required
@click.option("--gpus", type=click.IntRange(min=1), required=True, help="the job's GPU count")
@click.option("--cost", default=None, help="measured stall per checkpoint (30s, 2m)")
@click.option("--mttf", "mttf_text", default=None, help="MTTF for this size (7.9h); default: "
              "measured from accounting (`fleet mttf`), else [ckpt] mttf_h")
@since_option(help=None, default="30d", show_default=True)
@click.pass_obj
def interval(obj: Context, gpus: int, cost: str | None, mttf_text: str | None, since: str) -> None:
    """The Young/Daly checkpoint interval for a job of this size."""
    cfg = obj.config_or_exit().ckpt
    cost_s = parse_cost(cost) if cost else cfg.ckpt_cost_s
    measured: float | None
    if mttf_text:
        measured, source = parse_cost(mttf_text) / 3600, "--mttf"
    else:
        measured, source = _measured_mttf(obj, gpus, since)
    if measured is None:
        if not cfg.mttf_h:
            raise click.ClickException(f"{source} and no [ckpt] mttf_h: give --mttf (7.9h), "
                                       "or set [ckpt] mttf_h")
        measured, source = cfg.mttf_h, "[ckpt] mttf_h"
    mttf_h: float = measured
    c = cost_s / 3600
    click.echo(f"{gpus} GPUs: MTTF {human_hours(mttf_h)} ({source}), checkpoint cost "
               f"{cost_s:g} s")
    click.echo(f"Young: every {human_hours(young(c, mttf_h))}; Daly: every "
               f"{human_hours(daly(c, mttf_h))}")


def _measured_mttf(obj: Context, gpus: int, since: str) -> tuple[float | None, str]:
    """The MTTF for ``gpus`` from accounting and where it came from; None and why not."""
    # Only `interval` without --mttf reads the accounting history.
    from gpuwarden.accounting.attribution import gpu_class  # noqa: PLC0415
    from gpuwarden.accounting.mttf import report  # noqa: PLC0415

    try:
        hist = load_history(obj, since, (), None, obj.config_or_exit().lemon.grace_s)
    except click.ClickException as exc:
        # Not "no failures": a history that could not be read says nothing about failures.
        return None, f"the accounting history cannot be read ({exc.format_message()})"
    rep = report(hist.attribution, hist.events, 8, 30.0, (gpus,), windows=hist.windows)
    for c in rep.classes:
        if c.gpus == gpu_class(gpus) and c.mttf_h:
            return c.mttf_h, f"measured: {c.failures} failures in {c.hours:.0f} job-hours"
    if rep.per_gpu_mttf_h:
        return rep.per_gpu_mttf_h / gpus, "projected 1/N from the fleet's per-GPU rate"
    # The window really read (a cluster younger than --since is read from its registration).
    read = hist.window_note.removeprefix("history read: ")
    return None, f"no failures of {gpus}-GPU jobs in the accounting read ({read})"
