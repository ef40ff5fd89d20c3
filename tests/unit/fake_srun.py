"""A stand-in for srun in unit tests: each task a local process, its output handled as srun
handles it (as seen with Slurm 24.11 in the test cluster, see gpuwarden/launch/steps.py):

* the tasks' stdout to srun's stdout;
* the tasks' stderr to srun's stderr, or, with ``--error=NAME`` (no %-pattern), to the file
  srun opens itself under that name on its own host;
* srun's own reports to its own stderr: ``srun: error: NODE: task R: Exited with exit code C``
  (or the signal's name) when a task ends non-zero, as it ends;
* its status: a task killed by a signal wins (128 + signal), else the highest exit code.

SIGTERM is passed on to every task (as srun does). Per task it sets SLURM_JOB_ID, SLURM_PROCID,
SLURM_NTASKS, SLURM_STEP_ID, SLURM_NODEID and SLURMD_NODENAME. ``FAKE_SRUN_SAYS``: lines srun
itself writes to its stderr once every task has started (srun's own words, e.g. a real
"Node failure on n1").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading


def main(args: list[str]) -> int:
    opts: dict[str, str] = {}
    while args and args[0].startswith("--"):
        key, eq, value = args.pop(0)[2:].partition("=")
        opts[key] = value if eq else (args.pop(0) if key == "ntasks" else "")
    nodes = opts["nodelist"].split(",")
    assert len(nodes) == int(opts["ntasks"]), opts
    err_fd = os.open(opts["error"], os.O_WRONLY | os.O_APPEND) if "error" in opts else 2
    step_id = str(os.getpid())
    procs: list[subprocess.Popen[bytes]] = []
    for rank, node in enumerate(nodes):
        env = {**os.environ, "SLURM_JOB_ID": opts["jobid"], "SLURM_PROCID": str(rank),
               "SLURM_NTASKS": str(len(nodes)), "SLURM_STEP_ID": step_id,
               "SLURM_NODEID": str(rank), "SLURMD_NODENAME": node}
        procs.append(subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE))

    def relay(src: int, dst: int) -> None:
        while chunk := os.read(src, 4096):
            os.write(dst, chunk)

    def finish(rank: int) -> None:
        p = procs[rank]
        code = p.wait()
        if code > 0:
            say(f"srun: error: {nodes[rank]}: task {rank}: Exited with exit code {code}")
        elif code < 0:
            say(f"srun: error: {nodes[rank]}: task {rank}: {signal.strsignal(-code)}")

    def say(line: str) -> None:
        os.write(2, (line + "\n").encode())

    threads = []
    for rank, p in enumerate(procs):
        assert p.stdout is not None and p.stderr is not None
        threads += [threading.Thread(target=relay, args=(p.stdout.fileno(), 1)),
                    threading.Thread(target=relay, args=(p.stderr.fileno(), err_fd)),
                    threading.Thread(target=finish, args=(rank,))]

    def on_term(signum: int, frame: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, on_term)
    for t in threads:
        t.start()
    for line in os.environ.get("FAKE_SRUN_SAYS", "").splitlines():
        say(line)
    for t in threads:
        t.join()
    codes = [p.returncode for p in procs]
    signals = [-c for c in codes if c < 0]
    return 128 + max(signals) if signals else max(codes, default=0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
