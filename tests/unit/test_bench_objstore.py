"""benchmarks/objstore.py without a cluster: its arguments, verdicts and exit codes, the shaping
that is always taken off, its refusal of a cluster that is not an objstore site, `--help`
without docker, and the code it runs inside node c1, against gpuwarden's real tiers over the
unit tests' fake S3 (the cluster run itself is the lead's: docs/test-cluster.md)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pwd
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks import objstore as bench
from devcluster import s3shape
from gpuwarden.ckpt import jobkey, s3tier, stagein_s3
from gpuwarden.ckpt.jobkey import JobKeys
from gpuwarden.ckpt.manifest import Manifest
from tests.unit.fake_s3 import FakeS3

ROOT = Path(__file__).resolve().parents[2]


# ---- arguments -----------------------------------------------------------------------------------
def test_shape_is_delay_and_rate_or_none() -> None:
    assert bench.parse_shape("15ms,1gbit") == s3shape.Shape("15ms", "1gbit")
    assert bench.parse_shape(" 40ms , 500mbit ") == s3shape.Shape("40ms", "500mbit")
    assert bench.parse_shape("none") is None
    assert bench.parse_shape("None") is None
    for bad in ("15ms", "15,1gbit", "15ms,fast", "", "1gbit,15ms"):
        with pytest.raises(argparse.ArgumentTypeError, match="DELAY,RATE"):
            bench.parse_shape(bad)


def test_defaults_are_the_designs_run() -> None:
    args = bench.parse_args([])
    assert (args.mb, args.shape, args.repeat, args.skip_recovery) == \
        (256, s3shape.Shape("15ms", "1gbit"), 3, False)
    args = bench.parse_args(["--shape", "none", "--mb", "8", "--repeat", "5", "--skip-recovery"])
    assert (args.mb, args.shape, args.repeat, args.skip_recovery) == (8, None, 5, True)


@pytest.mark.parametrize(("argv", "says"), [
    (["--shape", "15ms"], "--shape: '15ms'"),
    (["--shape", "fast,1gbit"], "delay 'fast'"),
    (["--repeat", "2"], "--repeat: 2: at least 3"),
    (["--mb", "6"], "--mb: 6: a multiple of 4"),
    (["--mb", "0"], "--mb: 0: a multiple of 4"),
])
def test_bad_arguments_exit_2_naming_what_is_wrong(argv: list[str], says: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err


# ---- verdicts ------------------------------------------------------------------------------------
def test_a_verdict_line_has_the_ratio_its_goal_and_pass_or_fail() -> None:
    met = bench.Verdict("1. S3 restore / tier-0 restore", 41.234, ">=", 13, "S3 2.1 s; tier 0 0.05 s")
    assert met.passed
    assert met.line() == ("1. S3 restore / tier-0 restore: 41.23 (goal >= 13): PASS\n"
                          "    S3 2.1 s; tier 0 0.05 s")
    missed = bench.Verdict("3. spare / requeue", 0.31, "<=", 0.25, "spare 20 s; requeue 64 s")
    assert not missed.passed
    assert missed.line().startswith("3. spare / requeue: 0.31 (goal <= 0.25): FAIL")
    # The goal itself is met, either way.
    assert bench.Verdict("x", 1.0, ">=", 1.0, "").passed
    assert bench.Verdict("x", 0.25, "<=", 0.25, "").passed
    with pytest.raises(ValueError, match="goal operator"):
        bench.Verdict("x", 1.0, ">", 1.0, "")


def test_exit_code_is_0_all_met_1_one_missed_2_nothing_judged() -> None:
    ok = bench.Verdict("a", 14.0, ">=", 13, "")
    bad = bench.Verdict("b", 0.9, ">=", 1.0, "")
    assert bench.exit_code([ok, ok]) == 0
    assert bench.exit_code([ok, bad]) == 1
    assert bench.exit_code([]) == 2
    assert bench.summary([ok, bad]) == "FAIL: 1 of 2 goals met"
    assert bench.summary([ok]) == "PASS: 1 of 1 goals met"


def test_a_ratio_needs_a_time_to_divide_by() -> None:
    assert bench.ratio(3.0, 1.5, "x") == 2.0
    with pytest.raises(bench.NoResult, match="tier-0 restore"):
        bench.ratio(3.0, 0.0, "tier-0 restore")


def test_medians_and_interleaving() -> None:
    assert bench.seconds([2.5, 2.0, 9.0]) == "2.500 s (median of 3: 2.500, 2.000, 9.000)"
    orders = [bench.interleaved(run, ("ours", "boto")) for run in range(4)]
    assert orders == [("ours", "boto"), ("boto", "ours")] * 2


def test_restored_ranks_are_read_from_the_jobs_output() -> None:
    text = ("rank 0: step 10 saved\nrank 2: restored step 10 from peer (restart 0)\n"
            "rank 0: restored step 10 from memory (restart 0)\nnoise rank 1: restored step 9\n"
            "rank 1: restored step 10 from memory (restart 1)\n")
    assert bench.restored_ranks(text) == {0, 1, 2}
    assert bench.restored_ranks("rank 0: step 5 saved\n") == set()


def test_the_probe_must_show_the_delay_each_way() -> None:
    shape = s3shape.Shape("15ms", "1gbit")
    assert bench.shaping_seen(31.0, shape)
    assert bench.shaping_seen(27.5, shape)  # timer slack
    assert not bench.shaping_seen(2.0, shape)  # the link is not shaped
    assert bench.shaping_seen(0.4, None)


# ---- shaping -------------------------------------------------------------------------------------
class FakeLink:
    def __init__(self, fail_shape: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_shape = fail_shape

    def shape(self, how: s3shape.Shape) -> None:
        self.calls.append(f"shape {how.delay} {how.rate}")
        if self.fail_shape:
            raise s3shape.ShapeError("container s3: `nft ...` failed (exit 1): Error: Could not "
                                     "process rule: Operation not permitted")

    def unshape(self) -> None:
        self.calls.append("unshape")


def test_the_link_is_unshaped_after_the_arms_even_when_one_fails() -> None:
    link = FakeLink()
    with pytest.raises(bench.NoResult), bench.shaped(link, s3shape.Shape("15ms", "1gbit"),
                                                     lambda m: None):
        link.calls.append("arm")
        raise bench.NoResult("an arm failed")
    assert link.calls == ["shape 15ms 1gbit", "arm", "unshape"]


def test_a_shaping_that_fails_half_way_is_taken_off_and_says_why() -> None:
    link = FakeLink(fail_shape=True)
    with pytest.raises(s3shape.ShapeError, match="Operation not permitted"), \
            bench.shaped(link, s3shape.Shape("15ms", "1gbit"), lambda m: None):
        link.calls.append("arm")
    assert link.calls == ["shape 15ms 1gbit", "unshape"]


def test_shape_none_runs_on_a_link_unshaped_first() -> None:
    link = FakeLink()
    with bench.shaped(link, None, lambda m: None):
        link.calls.append("arm")
    assert link.calls == ["unshape", "arm"]


# ---- refusals, --help ----------------------------------------------------------------------------
@pytest.fixture
def no_docker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "docker", None)  # `import docker` raises ImportError


def test_a_cluster_not_of_the_objstore_site_is_refused_before_docker(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        no_docker: None) -> None:
    monkeypatch.delenv("GPUWARDEN_SITE", raising=False)
    monkeypatch.delenv("GPUWARDEN_CLUSTER_NAME", raising=False)
    assert bench.main(["--skip-recovery"]) == 2
    err = capsys.readouterr().err
    assert "GPUWARDEN_SITE is 'fsx'" in err and "GPUWARDEN_SITE=objstore" in err


def test_no_docker_daemon_is_no_verdict(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str],
                                        no_docker: None) -> None:
    monkeypatch.setenv("GPUWARDEN_SITE", "objstore")
    monkeypatch.setenv("GPUWARDEN_CLUSTER_NAME", "gwobj")
    assert bench.main([]) == 2
    assert "no verdict: cannot reach the Docker daemon" in capsys.readouterr().err


def test_help_works_without_docker() -> None:
    code = ("import runpy, sys; sys.modules['docker'] = None; "
            "sys.argv = ['objstore.py', '--help']; "
            "runpy.run_path('benchmarks/objstore.py', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert res.returncode == 0, res.stderr
    for flag in ("--mb", "--shape", "--repeat", "--rank-mb", "--skip-recovery",
                 "GPUWARDEN_SITE=objstore"):
        assert flag in res.stdout


# ---- the code run inside node c1 -------------------------------------------------------------------
class TransferS3(FakeS3):
    """The fake bucket, with boto3's managed download as the boto3 arm calls it."""

    def __init__(self) -> None:
        super().__init__()
        self.configs: list[Any] = []

    def download_file(self, bucket: str, key: str, filename: str, Config: Any = None) -> None:
        self.configs.append(Config)
        Path(filename).write_bytes(self.objects[key])


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A node's config and tier-0 spool under tmp_path, S3 the fake, the site key given."""
    conf = tmp_path / "gpuwarden.toml"
    conf.write_text(f"""[cluster]
name = "gwobj"

[ckpt]
s3_bucket = "gpuwarden"
s3_endpoint = "http://s3:8333"
key_file = "{tmp_path}/ckpt.key"
stage_in_s3_env = "{tmp_path}/s3-stagein.env"
s3_get_part_mb = 1
s3_get_concurrency = 4
""")
    s3 = TransferS3()
    site = [("k1", bytes(range(1, 33)))]
    monkeypatch.setattr(s3tier, "client", lambda settings, credentials=None: s3)
    monkeypatch.setattr(stagein_s3, "read_env_file", lambda path: {})
    monkeypatch.setattr(jobkey, "load_site_keys", lambda path: site)
    env = {"GPUWARDEN_BENCH_CONFIG": str(conf), "GPUWARDEN_BENCH_SHM": str(tmp_path / "bench"),
           "GPUWARDEN_BENCH_JOB": "bench-objstore-1", "GPUWARDEN_BENCH_KEY": "ab" * 32}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield {"s3": s3, "site": site, "tmp": tmp_path}


def inside(monkeypatch: pytest.MonkeyPatch, *argv: str) -> dict[str, Any]:
    monkeypatch.setattr(sys, "argv", ["-c", *argv])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        exec(compile(bench._INSIDE, "<inside>", "exec"), {"__name__": "__inside__"})
    return json.loads(out.getvalue().strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_the_inside_code_measures_each_arm_on_the_real_tiers(
        node: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    info = inside(monkeypatch, "info")
    assert (info["cluster"], info["bucket"], info["shared_root"], info["get_part_mb"],
            info["get_concurrency"]) == ("gwobj", "gpuwarden", "", 1, 4)
    put = inside(monkeypatch, "put", "8", "4")
    assert put["bytes"] == 8 << 20 and put["shards"] == 4
    shards = [k for k in node["s3"].objects if "/rank-00000/step-" in k and "MANIFEST" not in k]
    assert len(shards) == 4 and all(len(node["s3"].objects[k]) == 2 << 20 for k in shards)
    for mode in ("t0", "s3", "ours"):
        assert inside(monkeypatch, mode)["s"] > 0
    assert inside(monkeypatch, "ours")["bytes"] == 8 << 20
    boto = inside(monkeypatch, "boto")
    assert boto["bytes"] == 8 << 20
    # The tier's own part size and concurrency, and nothing left behind in the spool.
    cfg = node["s3"].configs[0]
    assert (cfg.multipart_chunksize, cfg.multipart_threshold, cfg.max_concurrency) == \
        (1 << 20, 1 << 20, 4)
    assert not (node["tmp"] / "bench-boto" / "bench-objstore-1").exists()
    assert len(inside(monkeypatch, "probe", "3")["ms"]) == 3
    inside(monkeypatch, "clean")
    assert [k for k in node["s3"].objects if "bench-objstore-1" in k] == []
    assert not (node["tmp"] / "bench" / "bench-objstore-1").exists()


def test_the_index_waiter_reads_the_jobs_markers_with_the_key_the_prolog_derives(
        node: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    user = pwd.getpwuid(os.getuid())
    keys = JobKeys.of(jobkey.derive(node["site"], "gwobj", "42", user.pw_uid))
    settings = s3tier.S3Settings("gpuwarden")
    for rank in range(3):
        tier = s3tier.S3Tier("s3", settings, "job-42", rank, s3=node["s3"], keys=keys)
        for step in (5, 10) if rank else (5,):
            tier.commit(Manifest("job-42", step, 3, rank, (), 0.0, {}), {})
    assert inside(monkeypatch, "index", "42", user.pw_name, "3") == \
        {"step": 5, "ranks": 3, "refused": 0}
    tier = s3tier.S3Tier("s3", settings, "job-42", 0, s3=node["s3"], keys=keys)
    tier.commit(Manifest("job-42", 10, 3, 0, (), 0.0, {}), {})
    assert inside(monkeypatch, "index", "42", user.pw_name, "3")["step"] == 10
    # Another job's key (job 43 of the same user) verifies none of job 42's markers.
    assert inside(monkeypatch, "index", "43", user.pw_name, "3") == \
        {"step": None, "ranks": 0, "refused": 0}
