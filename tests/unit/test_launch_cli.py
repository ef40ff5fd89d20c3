"""`gpuwarden launch` and its Slurm side: the srun line, scancel, the job comment, the template."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

from gpuwarden.cli import cli
from gpuwarden.config.context import Context
from gpuwarden.launch.decide import Lost
from gpuwarden.launch.report import COMMENT_PREFIX, JobComment, comment
from gpuwarden.launch.settings import EXIT_REQUEUE
from gpuwarden.launch.steps import SrunSteps
from gpuwarden.slurm.runner import CommandResult

SITE = Path(__file__).parents[2] / "gpuwarden" / "sitefiles" / "ckpt"


class Recorder:
    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def run(self, argv: Sequence[str], timeout: float) -> CommandResult:
        self.calls.append(list(argv))
        return CommandResult(tuple(argv), 0, "", "")


def invoke(args: list[str], env: dict[str, str]) -> tuple[int, str]:
    res = CliRunner().invoke(cli, args, obj=Context(), env=env)
    return res.exit_code, res.output


def test_launch_is_a_command_and_says_what_it_needs() -> None:
    code, out = invoke(["launch", "--help"], {})
    assert code == 0 and "--spares" in out and "--no-kill" in out
    code, out = invoke(["launch", "--", "python", "train.py"], {"SLURM_JOB_ID": ""})
    assert code == 2 and "batch script" in out
    code, out = invoke(["launch", "--beat-s", "5", "--", "python", "train.py"],
                       {"SLURM_JOB_ID": "9"})
    assert code == 2 and "--deadline-s: at least 3 x beat_s" in out


def test_the_step_is_srun_in_rank_order_and_node_failures_are_read_from_its_stderr(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srun = tmp_path / "srun"
    seen = tmp_path / "seen.json"
    srun.write_text(
        "#!/usr/bin/env python3\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, open({str(seen)!r}, 'w'))\n"
        "print('srun: error: Node failure on c3', file=sys.stderr)\nsys.exit(1)\n")
    srun.chmod(0o755)
    monkeypatch.setenv("SLURM_HOSTFILE", "/somewhere/else")
    err = io.StringIO()
    steps = SrunSteps("9", Recorder(), str(srun), stderr=err)
    step = steps.start(["c4", "c3", "c1"], {"GPUWARDEN_LAUNCH_GEN": "2"}, ["python", "t.py"])
    while steps.poll(step) is None:
        time.sleep(0.01)
    assert steps.poll(step) == 1
    assert steps.failed_nodes(step) == ["c3"]
    assert "Node failure on c3" in err.getvalue()  # passed through to the job's log
    got = json.loads(seen.read_text())
    assert got["argv"] == ["--jobid=9", "--ntasks", "3",
                           "--distribution=arbitrary", "--nodelist=c4,c3,c1",
                           "--kill-on-bad-exit=0", "--export=ALL", "--overlap",
                           f"--error={got['argv'][8][8:]}", "python", "t.py"]
    assert got["argv"][8].startswith("--error=/proc/self/fd/")  # the tasks' stderr apart
    assert got["env"]["GPUWARDEN_LAUNCH_GEN"] == "2"
    assert "SLURM_HOSTFILE" not in got["env"]  # it would override the order asked for


def test_ending_a_step_cancels_it_in_slurm_by_its_step_id(tmp_path: Path) -> None:
    runner = Recorder()
    steps = SrunSteps("9", runner, "sleep")
    step = steps.start(["c1"], {}, ["30"])  # `sleep --jobid=9 ...` fails at once: no matter
    steps.cancel(step, "4")
    assert runner.calls == [["scancel", "--quiet", "9.4"]]
    steps.kill(step)


def test_the_lost_node_goes_into_the_jobs_own_comment_and_nothing_is_drained() -> None:
    runner = Recorder()
    rep = JobComment("9", runner)
    rep.lost([Lost(1, "c3", "no heartbeat for 10.2 s (deadline 10 s)")])
    rep.lost([Lost(0, "c1", "srun reported the node failed")])
    assert runner.calls[-1] == [
        "scontrol", "update", "JobId=9",
        "Comment=gpuwarden-launch: lost c3 (rank 1: no heartbeat for 10.2 s [deadline 10 s]); "
        "c1 (rank 0: srun reported the node failed)"]
    assert not any("nodename" in " ".join(c).lower() for c in runner.calls)


def test_a_long_comment_names_every_lost_node_and_the_newest_why() -> None:
    many = [Lost(r, f"node{r:03d}", "no heartbeat for 10.0 s (deadline 10 s)")
            for r in range(20)]
    text = comment(many)
    assert len(text) <= 1000 and text.startswith(COMMENT_PREFIX + "node000 (rank 0); ")
    assert text.endswith("node019 (rank 19: no heartbeat for 10.0 s [deadline 10 s])")


def test_the_spares_template_requeues_on_the_launchers_75() -> None:
    from gpuwarden.ckpt.job import EXIT_REQUEUE as CKPT_REQUEUE

    text = (SITE / "train_spares.sbatch").read_text()
    assert EXIT_REQUEUE == CKPT_REQUEUE == 75
    assert "#SBATCH --no-kill" in text and "EXIT_REQUEUE=75" in text
    assert "gpuwarden.cli launch --spares" in text
    assert "\nGW_PYTHON=" in text and "\nGW_KIT=" in text  # what install-files rewrites
