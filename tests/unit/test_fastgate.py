"""The prolog's fast path: a fresh good verdict lets a job start; anything else goes the full way."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpuwarden import config as configmod
from gpuwarden.ckpt import jobsheld
from gpuwarden.health import fastgate
from gpuwarden.health import store as storemod
from gpuwarden.health.model import CheckResult, Status, Verdict
from gpuwarden.health.probe import healthy_fake
from gpuwarden.health.store import Store

JOB_UID = 4321 if os.geteuid() == 0 else os.geteuid()


class Site:
    """A node's config, state and run directories under tmp_path, as the prolog sees them."""

    def __init__(self, root: Path, extra: str = "", probe: str = "fake") -> None:
        self.root = root
        self.state = root / "state"
        self.kmsg = root / "kmsg"
        self.gpus = root / "gpus.json"
        self.shm = root / "shm"
        self.config = root / "gpuwarden.toml"
        self.kmsg.write_text("")
        self.gpus.write_text(healthy_fake(2))
        self.shm.mkdir()
        self.shm.chmod(0o1777)
        self.fsx = root / "fsx"
        self.fsx.mkdir()
        self.fsx.chmod(0o1777)
        self.config.write_text(f"""
[health]
gpu_probe = "{probe}"
fake_gpu_file = "{self.gpus}"
kernel_log = "{self.kmsg}"
state_dir = "{self.state}"
verdict_max_age_s = 600.0
{extra}
[health.expected]
gpu_count = 2
[ckpt]
memory_root = "{self.shm}"
shared_root = "{self.fsx}"
""")
        self.environ = {"GPUWARDEN_CONFIG": str(self.config), "GPUWARDEN_RUN_DIR": str(root / "run"),
                        "SLURMD_NODENAME": "c1", "SLURM_JOB_ID": "7",
                        "SLURM_JOB_UID": str(JOB_UID), "SLURM_JOB_GID": str(JOB_UID)}
        # Later than the files were written by more than the margin the fast path allows
        # for (budget + clock slack): they predate the verdict.
        self.now = self.kmsg.stat().st_mtime + 300

    def verdict(self, status: Status = Status.OK, age_s: float = 0.0, node: str = "c1") -> None:
        Store(str(self.state)).save_verdict(Verdict(node, self.now - age_s, "health check", (
            CheckResult("gpu", Status.OK, "fine"), CheckResult("other", status, "as told"))),
            fake_fp=fastgate.fingerprint(str(self.gpus)))

    def check(self, **env: str) -> str:
        return fastgate.check({**self.environ, **env}, now=self.now)


@pytest.fixture
def site(tmp_path: Path) -> Site:
    s = Site(tmp_path)
    s.verdict()
    assert fastgate.remember(s.environ) == ""
    return s


def kmsg_record(pri: int, at: float, message: str) -> str:
    usec = int((at - fastgate._boot_time()) * 1e6)
    return f"{pri},4711,{usec},-;{message}\n"


def test_a_fresh_good_verdict_lets_the_job_start(site: Site) -> None:
    assert site.check() == ""
    site.verdict(Status.WARNING)
    assert site.check() == ""


def test_without_settings_from_a_full_prolog_the_full_path_runs(tmp_path: Path) -> None:
    s = Site(tmp_path)
    s.verdict()
    assert "no fast-path settings" in s.check()
    assert fastgate.remember(s.environ) == ""
    assert s.check() == ""


def test_an_edited_config_sends_the_next_prolog_the_full_way(site: Site) -> None:
    site.config.write_text(site.config.read_text() + "\n# edited\n")
    assert "config" in site.check()


@pytest.mark.parametrize(("change", "why"), [
    ({"status": Status.CRITICAL}, "not OK"),
    ({"status": Status.UNKNOWN}, "not OK"),
    ({"age_s": 601.0}, "601 s old"),
    ({"age_s": -5.0}, "s old"),
    ({"node": "c2"}, "not this node's"),
])
def test_only_a_fresh_ok_verdict_of_this_node_counts(site: Site, change: dict, why: str) -> None:
    site.verdict(**change)
    assert why in site.check()


def test_a_requeued_job_goes_the_full_way_for_its_checkpoint_stage_in(site: Site) -> None:
    assert "requeued" in site.check(SLURM_JOB_RESTART_COUNT="1")
    assert "requeued" in site.check(SLURM_JOB_RESTART_COUNT="x")
    assert site.check(SLURM_JOB_RESTART_COUNT="0") == ""


def test_a_tier0_spool_not_yet_prepared_goes_the_full_way(site: Site) -> None:
    site.shm.chmod(0o755)
    assert "spool" in site.check()
    site.shm.rmdir()
    assert "spool" in site.check()


@pytest.fixture
def logsite(tmp_path: Path) -> Site:
    """A site whose kernel log is written now (no fake GPU file to trip over)."""
    s = Site(tmp_path, probe="none")
    assert fastgate.remember(s.environ) == ""
    return s


def append(site: Site, text: str) -> None:
    with site.kmsg.open("a") as f:
        f.write(text)
    site.now = time.time() + 1
    site.verdict()


def test_a_driver_record_since_the_verdict_goes_the_full_way(logsite: Site) -> None:
    now = time.time()
    append(logsite, kmsg_record(3, now - 150, "NVRM: Xid (PCI:0000:18:00): 79, old news")
           + kmsg_record(14, now, "NVRM: Xid (PCI:0000:18:00): 79, from a user"))
    assert logsite.check() == ""  # an old record, and one not from the kernel facility
    append(logsite, kmsg_record(3, now, "NVRM: Xid (PCI:0000:18:00): 79, pid=1, fell off"))
    assert "NVIDIA driver kernel record" in logsite.check()


def test_a_driver_line_in_another_log_rendering_goes_the_full_way(logsite: Site) -> None:
    append(logsite, "[12345.678] NVRM: Xid (PCI:0000:18:00): 79, fell off the bus\n")
    assert "driver line" in logsite.check()


def test_a_fake_gpu_file_changed_since_the_verdict_goes_the_full_way(site: Site) -> None:
    assert site.check() == ""
    site.gpus.write_text(healthy_fake(1))  # a fault injected right after the verdict
    assert "fake GPU file" in site.check()


def test_a_fake_gpu_file_written_just_before_the_verdict_is_not_a_change(site: Site) -> None:
    """Found in the cluster: a test fixture rewrote the file, the periodic check read it, and
    the fast path still took it for a change (it compared times, with a budget's margin)."""
    site.gpus.write_text(healthy_fake(2))
    site.verdict()
    assert site.check() == ""


def test_mounts_are_checked_again(tmp_path: Path) -> None:
    s = Site(tmp_path, extra='\n[health.classes.a]\nnodes = "c1"\n'
                           '[health.classes.a.expected]\ngpu_count = 2\n'
                           'mounts = [{path = "/"}, {path = "/no/such/mount"}]\n')
    s.verdict()
    assert fastgate.remember(s.environ) == ""
    assert "/no/such/mount is not mounted" in s.check()


def test_a_check_that_hangs_is_abandoned_at_the_deadline() -> None:
    t0 = time.monotonic()
    why = fastgate.in_child(lambda: time.sleep(600) or "", 0.2)
    assert "did not answer within 0.2 s" in why
    assert time.monotonic() - t0 < 10  # not the 600 s the check would take
    # A deadline that must not fire: generous, so a loaded machine cannot fire it.
    assert "ZeroDivisionError" in fastgate.in_child(lambda: str(1 / 0), 30.0)


def test_state_others_can_write_is_never_trusted(site: Site) -> None:
    (site.root / "run").chmod(0o777)
    assert "writable by group or others" in site.check()


def test_the_fast_path_follows_the_full_paths_own_rules() -> None:
    assert fastgate.CONFIG_ENV == configmod.ENV_VAR
    assert str(configmod.DEFAULT_PATH) == fastgate.DEFAULT_CONFIG
    assert fastgate.VERDICT == Store.FAST
    assert fastgate.VERDICT_FORMAT == storemod.FAST_FORMAT


def test_the_fast_path_imports_almost_nothing() -> None:
    """Reproduced: the prolog imported click, tomllib and every config dataclass before
    looking at the stored verdict: +186-200 ms per job start."""
    out = subprocess.run([sys.executable, "-I", "-X", "importtime", "-c",
                          "import gpuwarden.hooks.run, gpuwarden.health.fastgate"],
                         capture_output=True, text=True, check=True, timeout=30)
    loaded = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}
    for heavy in ("click", "tomllib", "dataclasses", "gpuwarden.config", "logging", "pickle",
                  "gpuwarden.health.model", "typing", "prometheus_client"):
        assert heavy not in loaded, f"the fast path imports {heavy}"


REPO = Path(__file__).resolve().parents[2]
# Run by a bare interpreter (-S: no site, whose imports would hide the fast path's own), as
# in the cluster's nodes, where gpuwarden is on the path but nothing has imported re & co.
_BARE = """
import os, sys
sys.path.insert(0, sys.argv[1])
from gpuwarden.health import fastgate
print(repr(fastgate.check(os.environ, now=float(sys.argv[2]))))
fastgate.mountprobe.read_mountinfo_points()  # what the forked child does, here to be seen
print(" ".join(sorted(sys.modules)))
"""


def test_the_fast_path_imports_neither_json_nor_re_nor_contextlib(site: Site) -> None:
    """Reproduced (issue 11 item 7): json (re, enum, functools, collections) and contextlib
    cost 10-14 ms of the fast path's 14-20 ms of imports on a cluster node, signal another
    1.5 (enum)."""
    out = subprocess.run([sys.executable, "-I", "-S", "-c", _BARE, str(REPO), str(site.now)],
                         env=site.environ, capture_output=True, text=True, check=True, timeout=30)
    why, modules = out.stdout.splitlines()
    assert why == "''"  # the whole fast path ran, and let the job start
    loaded = set(modules.split())
    for heavy in ("json", "re", "contextlib", "enum", "signal", "functools", "collections",
                  "typing", "dataclasses", "tomllib", "click", "encodings.unicode_escape",
                  "prometheus_client", "gpuwarden.core.metrics"):
        assert heavy not in loaded, f"the fast path imports {heavy}"


def test_the_fast_path_reads_only_the_summary_and_only_root_s(site: Site) -> None:
    summary = site.state / fastgate.VERDICT
    assert summary.stat().st_mode & 0o777 == 0o600
    summary.chmod(0o666)  # anyone could have written what it says
    assert "not ours alone" in site.check()
    summary.unlink()  # the JSON alone is not read
    assert "no stored verdict" in site.check()


@pytest.mark.parametrize("data", [b"", b"{half", b"\xfb\x00", marshal.dumps([1, 2])])
def test_unreadable_marshal_files_send_the_job_the_full_way(site: Site, data: bytes) -> None:
    for path in (site.state / fastgate.VERDICT, site.root / "run" / fastgate.SETTINGS):
        saved = path.read_bytes()
        path.write_bytes(data)
        assert "fast path unavailable" in site.check()
        path.write_bytes(saved)
        assert site.check() == ""


def test_settings_are_written_only_to_a_private_directory(site: Site) -> None:
    data = marshal.loads((site.root / "run" / fastgate.SETTINGS).read_bytes())
    assert data["node"] == "c1" and data["state_dir"] == str(site.state)
    assert oct(os.stat(site.root / "run").st_mode & 0o777) == "0o700"


def test_the_fast_path_makes_the_jobs_checkpoint_directories_as_the_full_prolog_does(
        site: Site) -> None:
    """Found in the cluster: the fast path let jobs start without the prolog's part of
    gpuwarden.ckpt.jobdirs, so a squatted future job id failed the job at restore."""
    assert site.check() == ""
    for path in (site.shm / "job-7", site.shm / "job-7.peer", site.fsx / "job-7"):
        st = path.lstat()
        assert path.is_dir() and not path.is_symlink()
        assert (st.st_uid, st.st_mode & 0o777) == (JOB_UID, 0o700)
    assert site.check() == ""  # the job's own directories are kept as they are


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another uid's directory)")
@pytest.mark.parametrize("squat", ["shm", "fsx", "link"])
def test_a_squatted_job_directory_sends_the_job_the_full_way(site: Site, squat: str) -> None:
    if squat == "link":
        (site.shm / "job-7").symlink_to(site.root)
    else:
        path = getattr(site, squat) / "job-7"
        path.mkdir(mode=0o700)
        os.chown(path, 65534, 65534)
    assert "checkpoint directory" in site.check()


def test_a_job_without_a_plain_uid_goes_the_full_way(site: Site) -> None:
    assert "not plain digits" in site.check(SLURM_JOB_UID="")
    assert "not plain digits" in site.check(SLURM_JOB_ID="7/../8")


def test_an_objstore_sites_job_goes_the_full_way_for_its_checkpoint_key(tmp_path: Path) -> None:
    """Found in the objstore test cluster: a node whose verdict was fresh let the job start by
    the fast path, which never wrote the job's key (ckpt.jobkey.for_prolog): that node's rank
    stopped at start, "job-2.key is missing"."""
    s = Site(tmp_path)
    key = tmp_path / "site.key"
    key.write_text("k1 " + "ab" * 32 + "\n")
    key.chmod(0o600)
    s.config.write_text(s.config.read_text() + f'key_file = "{key}"\n')
    s.verdict()
    assert fastgate.remember(s.environ) == ""
    assert "checkpoint key" in s.check()


def test_the_fast_path_records_the_job_for_the_checkpoint_scan_as_the_full_path_does(
        tmp_path: Path) -> None:
    """With [health] prom_dir set, the periodic check's tier-0 scan reads root's record of the
    jobs the prolog started here (ckpt.jobsheld): a job started by the fast path was never
    recorded, so its steps were left out of the node's checkpoint metrics."""
    s = Site(tmp_path, extra=f'prom_dir = "{tmp_path / "prom"}"')
    s.verdict()
    assert fastgate.remember(s.environ) == ""
    assert s.check() == ""
    held, left_out = jobsheld.held(str(s.state))
    assert [(h.job_id, h.uid) for h in held] == [("7", JOB_UID)] and left_out == 0
    assert abs(held[0].since - time.time()) < 60
    # Byte for byte the record jobsheld.record writes for the same job and moment.
    written = (s.state / jobsheld.DIR / "job-7").read_bytes()
    jobsheld.record(str(s.state), "8", JOB_UID, held[0].since)
    assert written == (s.state / jobsheld.DIR / "job-8").read_bytes()


def test_without_prom_dir_the_fast_path_records_nothing(site: Site) -> None:
    assert site.check() == ""
    assert not (site.state / jobsheld.DIR).exists()
