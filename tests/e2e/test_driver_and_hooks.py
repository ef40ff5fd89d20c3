"""Issue 11 items 3, 4 (hooks) and 7 in the real cluster: a driver NVML cannot open drains the
node; hooks that cannot start fail open; the prolog's fast path answers a fresh good verdict."""

from __future__ import annotations

import json

import pytest

from devcluster.cluster import VENV_PYTHON
from devcluster.harness import Harness
from tests.e2e.test_foundation import sinfo_reasons
from tests.e2e.test_health import clean, periodic  # noqa: F401 - the fixture is used by name

pytestmark = pytest.mark.timeout(300)
JOB_ENV = "SLURM_JOB_ID=4243 SLURM_JOB_UID=2001 SLURM_JOB_GID=2001"
PROLOG = "SLURMD_NODENAME={n} " + JOB_ENV + " /opt/gpuwarden/prolog/gpuwarden-prolog"


def test_a_driver_nvml_cannot_open_drains_the_node(clean: Harness) -> None:  # noqa: F811
    h = clean
    h.write_fake("c4", "gpus.json", json.dumps(
        {"gpus": [], "init_error": "NVMLError_LibRmVersionMismatch: RM has detected an "
                                   "NVML/RM version mismatch."}))
    periodic(h, "c4")
    assert "GPU driver unusable" in sinfo_reasons(h)["c4"]
    assert "NVMLError_LibRmVersionMismatch" in sinfo_reasons(h)["c4"]


def test_a_prolog_that_cannot_import_gpuwarden_lets_the_job_run(clean: Harness) -> None:  # noqa: F811
    h = clean
    # The file install-files wrote (the venv's interpreter) comes back afterwards.
    h.sh("c5", "cp -p /etc/default/gpuwarden /root/gpuwarden.defaults").check("save defaults")
    h.sh("c5", "printf 'GPUWARDEN_PYTHON=/nonexistent/venv/bin/python\\n' > /etc/default/gpuwarden"
               " && chmod 644 /etc/default/gpuwarden").check("defaults")
    try:
        res = h.sh("c5", PROLOG.format(n="c5"))
        assert res.rc == 0 and "health gating is OFF" in res.err
        # The system interpreter, without gpuwarden: still fails open.
        h.sh("c5", "printf 'GPUWARDEN_PYTHON=/usr/bin/python3\\n' > /etc/default/gpuwarden"
             ).check("defaults")
        res = h.sh("c5", "cd / && env -i /opt/gpuwarden/epilog/gpuwarden-epilog")
        assert res.rc == 0
        # A user's venv named by hand, with a .pth of theirs: refused before Python starts
        # (docs/admin-guide.md step 3), the job still runs, nothing of theirs ran as root.
        h.sh("c5", "rm -rf /home/alice/venv /tmp/gw-ran-as && runuser -u alice -- python3 -m venv "
                   "--without-pip /home/alice/venv").check("alice's venv")
        pth = "import os; open('/tmp/gw-ran-as', 'w').write(str(os.getuid()))"
        h.sh("c5", f"for d in /home/alice/venv/lib/python3*/site-packages; do echo \"{pth}\" > "
                   "\"$d/x.pth\" && chown alice \"$d/x.pth\"; done && printf "
                   "'GPUWARDEN_PYTHON=/home/alice/venv/bin/python\\n' > /etc/default/gpuwarden"
             ).check("alice's .pth")
        res = h.sh("c5", PROLOG.format(n="c5"))
        assert res.rc == 0 and "refusing to run /home/alice/venv/bin/python as root" in res.err, \
            res.err
        assert h.sh("c5", "test -e /tmp/gw-ran-as").rc != 0
    finally:
        h.sh("c5", "cp -p /root/gpuwarden.defaults /etc/default/gpuwarden").check("restore")
    assert "c5" not in sinfo_reasons(h)
    res = h.sh("c5", "/opt/gpuwarden/prolog/gpuwarden-healthcheck")
    assert res.rc == 0 and "healthy" in res.err and "OFF" not in res.err, res.err


def test_the_prolog_fast_path_answers_a_fresh_good_verdict(clean: Harness) -> None:  # noqa: F811
    h = clean
    periodic(h, "c6")
    assert h.sh("c6", PROLOG.format(n="c6")).rc == 0  # full path: leaves the settings
    assert h.sh("c6", "test -f /run/gpuwarden/prolog-gate.marshal").rc == 0
    res = h.sh("c6", f"{JOB_ENV} {VENV_PYTHON} -I -c \"from gpuwarden.health import fastgate; import os; "
                     "print(repr(fastgate.check(dict(os.environ, SLURMD_NODENAME='c6'))))\"")
    assert res.out.strip() == "''", res.out
    # A fatal XID since the verdict: the fast path hands over and the full prolog drains.
    h.inject_xid("c6", 5, 79)
    assert h.sh("c6", PROLOG.format(n="c6")).rc == 1
