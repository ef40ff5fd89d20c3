"""`gpuwarden health selftest`: what an admin runs on a node before enabling the hooks.

Each step says what it found and, when it failed, what to fix. The dry run drives the real
periodic check, prolog gate and epilog against a copy of the node's state and a Slurm client
that reads but never writes, so nothing changes on the node or in Slurm.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from gpuwarden.config import Config
from gpuwarden.config.context import Context
from gpuwarden.core.deadline import run_all as run_with_deadline
from gpuwarden.core.errors import GpuwardenError, SlurmError
from gpuwarden.core.safefs import atomic_write, discard, ensure_private_dir
from gpuwarden.health.store import Store
from gpuwarden.hooks import entry
from gpuwarden.slurm import bindir, jobenv
from gpuwarden.slurm.client import SlurmClient
from gpuwarden.slurm.models import AcctJob, Job, Node, NodeEvent, NodeView

# What the hooks import on their way: the command tree, the health group and the hooks'
# commands it attaches, the entry points and what they check with.
_MODULES = ("gpuwarden.cli", "gpuwarden.health.cli", "gpuwarden.hooks.cli",
            "gpuwarden.hooks.entry", "gpuwarden.health.gather", "gpuwarden.health.gate",
            "gpuwarden.slurm.drain", "gpuwarden.health.xid", "gpuwarden.ckpt.stagein")
_SLURM_LIMIT_S = 15.0
DEFAULTS_FILE = "/etc/default/gpuwarden"  # what the shipped hooks read (gpuwarden.install.plan)


@dataclass(frozen=True)
class Finding:
    name: str
    ok: bool
    detail: str
    fix: str = ""


@dataclass
class ReadOnlySlurm:
    """Reads go to Slurm; every write is only written down."""

    inner: SlurmClient
    writes: list[str] = field(default_factory=list)

    def nodes(self) -> list[Node]:
        return self.inner.nodes()

    def node(self, name: str) -> Node:
        return self.inner.node(name)

    def partitions(self) -> dict[str, tuple[str, ...]]:
        return self.inner.partitions()

    def jobs(self) -> list[Job]:
        return self.inner.jobs()

    def job(self, job_id: int) -> Job:
        return self.inner.job(job_id)

    def acct_jobs(self, start: str, end: str) -> Iterator[AcctJob | SlurmError]:
        return self.inner.acct_jobs(start, end)

    def events(self, start: str, end: str) -> list[NodeEvent]:
        return self.inner.events(start, end)

    def out_of_service(self, also: Sequence[str] = ()) -> NodeView:
        return self.inner.out_of_service(also)

    def partition_sizes(self) -> dict[str, int]:
        return self.inner.partition_sizes()

    def drain(self, name: str, reason: str, *, in_service_only: bool = False) -> None:
        self.writes.append(f"drain {name}: {reason}")

    def set_comment(self, name: str, text: str) -> None:
        self.writes.append(f"comment {name}: {text!r}")

    def resume(self, name: str, *, expect_reason: str | None = None) -> bool:
        self.writes.append(f"resume {name}")
        return True

    def set_extra(self, name: str, text: str) -> None:
        self.writes.append(f"extra {name}: {text}")

    def set_switch_wait(self, job_id: int, wait_s: int, admin_comment: str,
                        comment: str | None) -> None:
        self.writes.append(f"switch wait {job_id}: {wait_s}")

    def requeue(self, job_id: int) -> None:
        self.writes.append(f"requeue {job_id}")


def _step(name: str, fn: Callable[[], str], fix: str) -> Finding:
    try:
        return Finding(name, True, fn())
    except (GpuwardenError, OSError, ImportError, ValueError) as exc:
        return Finding(name, False, str(exc) or exc.__class__.__name__, fix)


def hook_python_finding() -> Finding:
    """The hooks' rule on the interpreter they would start (from DEFAULTS_FILE, read as they
    read it), checked as they check it on every start (gpuwarden.install.hookrule)."""
    from gpuwarden.install import hookrule  # noqa: PLC0415
    from gpuwarden.install.run import source_dir  # noqa: PLC0415

    sitefiles = source_dir()
    python = hookrule.hooks_python(DEFAULTS_FILE, sitefiles)
    found = hookrule.problems(python, sitefiles) if python else ["no interpreter named"]
    if not found:
        return Finding("hook interpreter", True,
                       f"{python}: everything it imports is root's alone")
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    return Finding("hook interpreter", False,
                   f"the hooks would refuse to run {python}: {found[0]}{more}",
                   "make every directory it imports from root's and writable by nobody else, "
                   "or install gpuwarden into a venv made as root (python3 -m venv "
                   f"/opt/gpuwarden/venv) and name it in {DEFAULTS_FILE} (gpuwarden "
                   "install-files does both); docs/admin-guide.md step 2")


def _imports(cfg: Config | None) -> str:
    mods = list(_MODULES)
    if cfg is not None and cfg.health.gpu_probe == "nvml":
        mods.append("pynvml")
    source = cfg.ckpt.stage_in_source() if cfg is not None else ""
    if source:
        # The prolog's stage-in needs the checkpoint extra (numpy, xxhash), and from S3 boto3.
        mods.append("gpuwarden.ckpt.stagecopy")
    if source == "s3":
        mods.append("gpuwarden.ckpt.stagein_s3")
    for m in mods:
        importlib.import_module(m)
    return f"{len(mods)} modules import"


def _writable(directory: str, private: bool) -> str:
    # As the hooks write there: made if missing, reached by safefs's walk, ours alone.
    ensure_private_dir(directory, mode=0o700 if private else 0o755)
    atomic_write(directory, ".selftest", b"ok\n")
    discard(directory, ".selftest")
    return f"{directory} writable"


def _deadline(name: str, fn: Callable[[], Any], seconds: float) -> Any:
    out = run_with_deadline({name: fn}, seconds)[name]
    if out.timed_out:
        raise GpuwardenError(f"no answer within {seconds:g} s")
    if out.error:
        raise GpuwardenError(out.error)
    return out.value


def _kernel_log(cfg: Config) -> str:
    from gpuwarden.health.gather import read_kernel_log  # noqa: PLC0415
    from gpuwarden.health.kernlogtrust import problem  # noqa: PLC0415

    text, _ = _deadline("kernel log", lambda: read_kernel_log(cfg.health.kernel_log),
                        cfg.health.check_timeout_s)
    # A rendering a user can forge lines in, or one gpuwarden cannot read, fails the self-test.
    why = problem(cfg.health.kernel_log, text)
    if why:
        raise GpuwardenError(why)
    if not text.strip():
        return f"{cfg.health.kernel_log}: empty, its rendering is checked once it has records"
    return f"{cfg.health.kernel_log}: {text.count(chr(10)) + 1} lines read, rendering trusted"


def _gpu(cfg: Config, node: str) -> str:
    from gpuwarden.health.gather import make_probe  # noqa: PLC0415

    probe = make_probe(cfg.health)
    if probe is None:
        return "gpu_probe = \"none\": no GPU checks on this node"
    snap = _deadline("gpu", probe.snapshot, cfg.health.check_timeout_s)
    want = cfg.health.expected_for(node).gpu_count
    seen = len(snap.gpus)
    if want and seen != want:
        raise GpuwardenError(f"{seen} GPUs seen, {want} expected for {node}")
    return f"{seen} GPUs seen ({snap.driver or 'driver version unknown'})"


def _dry_run(cfg: Config, client: SlurmClient, environ: Mapping[str, str]) -> list[Finding]:
    """Periodic, prolog and epilog as Slurm would run them, on a scratch copy of the state."""
    live = Store(cfg.health.state_dir)
    out = []
    with tempfile.TemporaryDirectory(prefix="gpuwarden-selftest.") as tmp:
        state = os.path.join(tmp, "state")
        copy = Store(state)
        stored, counters = live.load_stored(), live.load_counters()
        if stored is not None:  # a partial verdict stays marked partial in the copy
            copy.save_verdict(stored[0], stored[1])
        copy.save_counters(counters)
        health = replace(cfg.health, state_dir=state, prom_dir="")
        dry_cfg = replace(cfg, health=health)
        job = {**environ, jobenv.JOB_ID: jobenv.job_id(environ, "0")}
        runs: list[tuple[str, Callable[[entry.Env], int], Mapping[str, str]]] = [
            ("periodic", entry.periodic, environ),
            ("prolog", entry.prolog_gate, job),
            # epilog_gate: the real epilog would free the job's tier-0 directories.
            ("epilog", entry.epilog_gate, {**job, jobenv.JOB_EXIT_CODE: "1"}),
        ]
        for name, fn, env_vars in runs:
            slurm = ReadOnlySlurm(client)
            env = entry.Env(config=dry_cfg, client=slurm, environ=env_vars, sleep=lambda s: None)
            try:
                rc = fn(env)
            except (GpuwardenError, OSError) as exc:
                env.problems.setdefault("internal", str(exc))
                rc = -1
            did = "; ".join(slurm.writes) or "no change to Slurm"
            if env.problems:
                out.append(Finding(f"dry run {name}", False,
                                   f"exit {rc}; would do: {did}; problems: "
                                   + "; ".join(env.problems.values()),
                                   "fix the problems named above (details in the log lines)"))
            else:
                out.append(Finding(f"dry run {name}", True, f"exit {rc}; would do: {did}"))
    return out


def run_all(obj: Context, environ: Mapping[str, str]) -> list[Finding]:
    """Every step; later steps that need the config are skipped when it cannot be loaded. The
    hooks' interpreter is judged whatever else fails (the dry runs use this process's)."""
    return [*_steps(obj, environ), hook_python_finding()]


def _steps(obj: Context, environ: Mapping[str, str]) -> list[Finding]:
    found: list[Finding] = []
    holder: dict[str, Config] = {}

    def config() -> str:
        holder["cfg"] = obj.config_required()
        return "valid"

    found.append(_step("config", config, "run `gpuwarden config check` and fix what it names"))
    cfg = holder.get("cfg")
    found.append(_step("imports", lambda: _imports(cfg),
                       "install gpuwarden (with [nvml] on GPU nodes) for the interpreter on the "
                       "hooks' first line"))
    if cfg is None:
        return found
    node = jobenv.slurmd_nodename(environ) or entry.Env(cfg, None, environ).node  # type: ignore[arg-type]

    def slurm_found() -> str:
        place = bindir.locate(cfg.slurm.bin_dir, use_path=False)
        return f"{place.path} ({place.how})"

    found.append(_step("slurm commands", slurm_found,
                       "set [slurm] bin_dir to the directory holding scontrol"))
    import time  # noqa: PLC0415

    client = obj.client_for(cfg, use_path=False, end=time.monotonic() + _SLURM_LIMIT_S)

    def answering() -> str:
        n = client.node(node)
        return f"slurmctld knows {node}: {n.state_text}{f', reason {n.reason!r}' if n.reason else ''}"

    found.append(_step("slurm answers", answering,
                       "check `scontrol ping` and that this node's name is its Slurm NodeName"))
    found.append(_step("state dir", lambda: _writable(cfg.health.state_dir, True),
                       f"create {cfg.health.state_dir} owned by root, mode 0700, on a filesystem "
                       "with space"))
    if cfg.health.prom_dir:
        found.append(_step("prom dir", lambda: _writable(cfg.health.prom_dir, False),
                           f"make {cfg.health.prom_dir} a directory root can write"))
    found.append(_step("kernel log", lambda: _kernel_log(cfg),
                       "run as root; set [health] kernel_log to /dev/kmsg (or a root-owned "
                       "file written by `journalctl -k -o json`)"))
    found.append(_step("gpu probe", lambda: _gpu(cfg, node),
                       "check the driver (`nvidia-smi`), [health] gpu_probe and gpu_count"))
    if all(f.ok for f in found):
        found.extend(_dry_run(cfg, client, {**environ, jobenv.NODENAME: node}))
    return found
