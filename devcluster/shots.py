"""The screenshots in docs/monitoring.md, taken from a running test cluster: Prometheus (Debian's
package, its classic web UI) with gpuwarden's shipped rules, after an Xid 79 on c3 (drained by
the periodic check) and a config typo on c5 (gating off there).

    GPUWARDEN_CLUSTER_NAME=<name> python -m devcluster.shots [OUTDIR]   # default docs/

The cluster must be up (`python -m devcluster up`); headless chromium takes the pictures
(`scripts/host-deps.sh chromium`). The rules' waits are the tests' (devcluster.monitor), so the
alerts fire within seconds. The node's config and drain are put back afterwards.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

from devcluster import monitor
from devcluster.harness import Harness

CONFIG = "/etc/gpuwarden/gpuwarden.toml"
HEALTHCHECK = "/opt/gpuwarden/prolog/gpuwarden-healthcheck"
PAGES = (  # file, Prometheus page, window height
    ("monitoring-alerts.png", "/classic/alerts", 720),
    ("monitoring-firing.png", "/classic/graph?" + urllib.parse.urlencode(
        {"g0.expr": 'ALERTS{alertstate="firing"}', "g0.tab": "1"}), 520),
)


def shoot(url: str, out: Path, height: int) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not installed: bash scripts/host-deps.sh chromium")
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1400,{height}", "--virtual-time-budget=8000",
                    f"--screenshot={out}", url], check=True, capture_output=True, timeout=120)


def scene(h: Harness) -> monitor.Monitor:
    mon = monitor.start(h)
    h.inject_xid("c3", 5, 79)
    h.exec("c3", [HEALTHCHECK], timeout=60)
    h.sh("c5", f"cp {CONFIG} /tmp/good.toml && "
               f"sed -i 's/^\\[health\\]$/[health]\\ndrian = true/' {CONFIG}").check("typo")
    h.exec("c5", [HEALTHCHECK], timeout=60)
    mon.wait(lambda: mon.firing("GpuwardenNodeDrainedTooLong", node="c3")
             and mon.firing("GpuwardenGatingOff", node="c5"), 120, "the two alerts")
    return mon


def undo(h: Harness) -> None:
    h.sh("c5", f"mv /tmp/good.toml {CONFIG}").check("config back")
    h.clear_gpu_faults("c3")
    h.exec("slurmctld", ["scontrol", "update", "nodename=c3", "state=resume"])


def main(argv: list[str]) -> int:
    import docker  # noqa: PLC0415 - the test extra

    from devcluster.cluster import Cluster  # noqa: PLC0415
    from devcluster.spec import from_env  # noqa: PLC0415

    out = Path(argv[0] if argv else "docs")
    h = Harness(Cluster(docker.from_env(timeout=300), from_env()))
    mon = scene(h)
    try:
        for name, page, height in PAGES:
            shoot(f"http://{mon.controller_ip}:{monitor.PROM_PORT}{page}", out / name, height)
            print(f"wrote {out / name}")
    finally:
        undo(h)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
