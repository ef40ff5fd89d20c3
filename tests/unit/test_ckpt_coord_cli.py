"""Issue 37, step 6: `gpuwarden ckpt coord -- COMMAND`, the sbatch templates' wrapper that runs
the job's coordinator beside srun on a site without a shared filesystem (and steps aside on one
with it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.ckpt import coordwrap, jobkey
from gpuwarden.ckpt.coordnet import ENV_COORD
from gpuwarden.ckpt.coordwrap import WrapError, child_env, with_export

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
FAKE_SRUN = Path(__file__).with_name("fake_srun.py")
KIT = REPO / "gpuwarden" / "sitefiles" / "ckpt"
JOB_ID = "612"
SITE = [("k1", b"\x07" * 32)]


def write_config(path: Path, **ckpt: object) -> str:
    path.write_text("[ckpt]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in ckpt.items()))
    return str(path)


@pytest.fixture
def site(tmp_path: Path) -> dict[str, Any]:
    """A site without a shared filesystem, and the prolog's key file for job 612."""
    key_dir = str(tmp_path / "run" / "gpuwarden-ckpt")
    jobkey.write_job_keys(key_dir, JOB_ID, os.geteuid(), os.getegid(),
                          jobkey.derive(SITE, "c1", JOB_ID, os.geteuid()))
    return {"memory_root": str(tmp_path / "mem"), "key_file": "/etc/gpuwarden/ckpt.key",
            "job_key_dir": key_dir, "agree_timeout_s": 30}


def batch_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "GPUWARDEN_"))}
    return {**env, "PYTHONPATH": str(REPO), "SLURM_JOB_ID": JOB_ID, "SLURM_NTASKS": "3",
            **extra}


def wrapper(config: str, *command: str) -> list[str]:
    return [sys.executable, "-m", "gpuwarden.cli", "--config", config, "ckpt", "coord",
            "--host", "127.0.0.1", "--", *command]


def run(config: str, *command: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(wrapper(config, *command), env=batch_env(**env), capture_output=True,
                          text=True, timeout=90, check=False)


# ---- where there is nothing to coordinate, the command runs in the wrapper's place -----------
@pytest.mark.parametrize("case", ["shared_root", "one task", "no key_file"])
def test_it_steps_aside_with_a_shared_root_a_single_task_or_no_key(tmp_path: Path,
                                                                   site: dict[str, Any],
                                                                   case: str) -> None:
    ckpt = {**site, "shared_root": str(tmp_path / "fsx")} if case == "shared_root" else \
        {"memory_root": site["memory_root"]} if case == "no key_file" else site
    cfg = write_config(tmp_path / "gw.toml", **ckpt)
    p = subprocess.Popen(wrapper(cfg, "sh", "-c", f'echo "$$ ${{{ENV_COORD}-none}}"'),
                         env=batch_env(**({"SLURM_NTASKS": "1"} if case == "one task" else {})),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0
    assert out.split() == [str(p.pid), "none"]  # exec'd: its pid, no coordinator
    # Without a key there can be no coordinator: said, and the ranks will say what to set.
    assert ("no checkpoint coordinator" in err) == (case == "no key_file")


# ---- without a shared filesystem ---------------------------------------------------------------
RANK = """
import json, os, sys
import numpy as np
from gpuwarden.ckpt.job import JobCheckpointer
cfg_dir, out = sys.argv[1], sys.argv[2]
node = os.environ["SLURMD_NODENAME"]
ck = JobCheckpointer.from_slurm(f"{cfg_dir}/{node}.toml")
got = ck.restore()
rank = ck.env.rank
if got is None:
    ck.save(5, {"w": np.full(1000, rank, dtype=np.float32)})
ck.finish(5, timeout=30)
with open(f"{out}/rank-{rank}-{ck.env.run}.json", "w") as f:
    json.dump({"coord": type(ck.coord).__name__, "step": got and got.step,
               "tier": got and got.tier,
               "ok": got is None or bool((got.state["w"] == rank).all())}, f)
"""


def test_three_ranks_under_srun_meet_at_the_wrappers_coordinator(tmp_path: Path,
                                                                  site: dict[str, Any]) -> None:
    nodes = ["nA", "nB", "nC"]
    for n in nodes:  # each node its own memory
        write_config(tmp_path / f"{n}.toml", **{**site, "memory_root": str(tmp_path / n)})
    (tmp_path / "rank.py").write_text(RANK)
    srun = [sys.executable, str(FAKE_SRUN), f"--jobid={JOB_ID}", "--ntasks=3",
            f"--nodelist={','.join(nodes)}", sys.executable, str(tmp_path / "rank.py"),
            str(tmp_path), str(tmp_path)]
    for restarts in ("0", "1"):
        res = run(write_config(tmp_path / "batch.toml", **site), *srun,
                  SLURM_RESTART_COUNT=restarts)
        assert res.returncode == 0, res.stderr
        assert f"job-{JOB_ID}'s checkpoint coordinator at 127.0.0.1:" in res.stderr
    got = {p.name: json.loads(p.read_text()) for p in tmp_path.glob("rank-*.json")}
    assert got == {
        **{f"rank-{r}-r0-s{s}.json": {"coord": "NetCoordinator", "step": None, "tier": None,
                                      "ok": True}
           for r in range(3) for s in [got_step(got, r, "r0")]},
        **{f"rank-{r}-r1-s{s}.json": {"coord": "NetCoordinator", "step": 5, "tier": "memory",
                                      "ok": True}
           for r in range(3) for s in [got_step(got, r, "r1")]}}


def got_step(got: dict[str, object], rank: int, run: str) -> str:
    """The srun step id fake_srun gave the run (its pid)."""
    [name] = [n for n in got if n.startswith(f"rank-{rank}-{run}-s")]
    return name[len(f"rank-{rank}-{run}-s"):-len(".json")]


PING = f"""
import os, sys
from gpuwarden.ckpt.coord import CoordError
from gpuwarden.ckpt.coordnet import NetCoordinator
from gpuwarden.ckpt.jobkey import read_job_keys
addr, key_dir = os.environ["{ENV_COORD}"], sys.argv[1]
key = read_job_keys(key_dir, "{JOB_ID}").signing[1]
print(NetCoordinator(addr, key, "job-{JOB_ID}", 1, 3).ping(), os.environ.get("SLURM_EXPORT_ENV"))
try:
    NetCoordinator(addr, b"x" * 32, "job-{JOB_ID}", 1, 3).ping()
except CoordError as exc:
    print("refused:", exc)
"""


def test_the_command_reaches_the_coordinator_with_the_jobs_key_only(
        tmp_path: Path, site: dict[str, Any]) -> None:
    res = run(write_config(tmp_path / "gw.toml", **site), sys.executable, "-c", PING,
              site["job_key_dir"], SLURM_EXPORT_ENV="NONE")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    (seen, export), refused = lines[0].split(), lines[1]
    assert int(seen) >= 1
    assert export == ENV_COORD  # srun --export=NONE would pass no GPUWARDEN_CKPT_COORD
    assert refused.startswith("refused:") and "key" in refused


@pytest.mark.parametrize(("script", "status"), [("exit 7", 7), ("kill -TERM $$", 143)])
def test_the_commands_exit_status_is_the_wrappers(tmp_path: Path, site: dict[str, Any],
                                                  script: str, status: int) -> None:
    assert run(write_config(tmp_path / "gw.toml", **site), "sh", "-c", script).returncode \
        == status


WAITS = """
import signal, sys, time
def on(sig, _f):
    print("got", signal.Signals(sig).name, flush=True)
    sys.exit(75)
signal.signal(signal.SIGUSR1, on)
signal.signal(signal.SIGINT, on)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("sig", "status", "said"), [(signal.SIGUSR1, 75, "got SIGUSR1\n"),
                                                     (signal.SIGINT, 75, "got SIGINT\n"),
                                                     (signal.SIGTERM, 143, "")])
def test_signals_reach_the_command(tmp_path: Path, site: dict[str, Any], sig: int,
                                   status: int, said: str) -> None:
    p = subprocess.Popen(wrapper(write_config(tmp_path / "gw.toml", **site),
                                 sys.executable, "-c", WAITS),
                         env=batch_env(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdout is not None
    assert p.stdout.readline() == "ready\n"
    p.send_signal(sig)
    assert p.wait(timeout=60) == status
    assert p.stdout.read() == said


def test_a_job_without_its_key_file_stops_before_the_command(tmp_path: Path,
                                                             site: dict[str, Any]) -> None:
    cfg = write_config(tmp_path / "gw.toml", **{**site, "job_key_dir": str(tmp_path / "no")})
    res = run(cfg, "sh", "-c", "echo ran")
    assert res.returncode == 1 and "ran" not in res.stdout
    assert "the prolog writes it" in res.stderr


def test_a_host_name_the_coordinator_cannot_be_reached_at_is_said_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordwrap, "READY_S", 0.3)
    with pytest.raises(WrapError, match=r"does not answer at \[::1\]:\d+.*--host"):
        coordwrap.serve(["true"], b"k" * 32, "job-1", "::1", {})  # it listens on IPv4


def test_a_wrapper_in_a_terminals_foreground_leaves_ctrl_c_to_the_terminal() -> None:
    # The terminal signals the whole foreground group, COMMAND too: a forwarded SIGINT would
    # be srun's second one ("cancel the step") where the user pressed Ctrl-C once.
    assert signal.SIGINT in coordwrap.forwarded(foreground=False)
    assert set(coordwrap.FORWARDED) - set(coordwrap.forwarded(foreground=True)) == {
        signal.SIGINT}


@pytest.mark.parametrize(("value", "want"), [
    (None, None), ("", None), ("ALL", "ALL"), ("ALL,FOO=1", "ALL,FOO=1"), ("all", "all"),
    ("NONE", ENV_COORD), ("NIL", ENV_COORD), ("FOO,BAR=2", f"FOO,BAR=2,{ENV_COORD}"),
    (f"FOO,{ENV_COORD}", f"FOO,{ENV_COORD}")])
def test_srun_is_made_to_pass_the_address_whatever_the_jobs_export(value: str | None,
                                                                  want: str | None) -> None:
    assert with_export(value, ENV_COORD) == want
    env = child_env({} if value is None else {"SLURM_EXPORT_ENV": value}, "h:1")
    assert env[ENV_COORD] == "h:1"
    assert env.get("SLURM_EXPORT_ENV") == (value if want is None else want)  # unset: as it was


@pytest.mark.parametrize("name", ["train.sbatch", "train_spares.sbatch"])
def test_both_templates_start_the_ranks_under_the_wrapper(name: str) -> None:
    text = (KIT / name).read_text()
    assert "$GW_PYTHON -I -m gpuwarden.cli ckpt coord -- " in text
    starts = [line for line in text.splitlines()
              if line.startswith(("srun ", "$GW_PYTHON -I -m gpuwarden.cli"))]
    assert starts and all("ckpt coord --" in line for line in starts), starts
