"""`gpuwarden health inject`: rehearse a drain on a TEST node, without a faulty GPU.

A real fault cannot be forged, on purpose: gpuwarden trusts only kernel-facility records, and
the kernel stamps whatever userspace writes to /dev/kmsg with facility LOG_USER. So injecting
works only on a node whose config reads its GPUs and its kernel log from test files
(``[health] gpu_probe = "fake"``, ``fake_gpu_file``, ``kernel_log`` = a file), as the test
cluster's nodes do. An Xid is written exactly as the NVIDIA driver prints it, in /dev/kmsg's
record format, so the same parser and policy that judge a real one drain the node.

Root only; the files are replaced atomically, never written through a link, and only in a
directory that root alone can write, reached from / without links through directories only root
can change (safefs.opened_dir, install-files' walk), then read and written through its
descriptor. A file is replaced only when it is absent or is a test file: /dev/kmsg-format
records, a fake GPU file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass

from gpuwarden.config.health import Expected, HealthConfig
from gpuwarden.core.errors import GpuwardenError, InstallError
from gpuwarden.core.safefs import StateDirError, opened_dir, read_own_at, write_at
from gpuwarden.health import kernlog
from gpuwarden.health.model import GpuObs
from gpuwarden.health.probe import ProbeError, healthy_fake, parse_fake
from gpuwarden.health.xidcatalog import CATALOG
from gpuwarden.health.xidpolicy import DRAINS, SUFFIX, Rule, xid_rule

KMSG = "/dev/kmsg"
MAX_BYTES = 16 << 20
DOC = "docs/testing-without-gpus.md"
# KERN_ERR from the kernel facility: <facility 0> * 8 + <level 3>, as the driver logs an Xid.
PRIORITY = 3
# What the driver prints after "<code>, pid=..., name=..., " for the codes worth rehearsing;
# any other code gets NVIDIA's catalog name.
DRIVER_TEXT = {
    79: "GPU has fallen off the bus.",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer "
        "at partition 0, subpartition 0.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    31: "Ch 00000010, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ "
        "0x0_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
    92: "High single-bit ECC error rate",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 "
         "(GSP_RM_CONTROL) (0x20801341 0x4).",
}
_SEQ = re.compile(rb"^(\d{1,4}),(\d{1,20}),")
_BUS_ID = re.compile(r"^([0-9a-f]{1,8}):([0-9a-f]{2}):([0-9a-f]{2})\.[0-7]$")


class InjectError(GpuwardenError):
    """Refused: not root, not a test node, or a test file that is not safe to write."""


@dataclass(frozen=True)
class FaultFiles:
    kernel_log: str
    fake_gpu_file: str


def is_root() -> bool:
    return os.geteuid() == 0


def fault_files(cfg: HealthConfig) -> FaultFiles:
    """The test files this node's config reads faults from; refused on a node that reads the
    real kernel log or real GPUs."""
    setup = (f'on a TEST node set [health] gpu_probe = "fake", fake_gpu_file and kernel_log '
             f"to files (see {DOC})")
    if not is_root():
        raise InjectError("run it as root (sudo gpuwarden health inject ...): the test files "
                          "are root's, like the hooks that read them")
    if cfg.kernel_log == KMSG:
        raise InjectError(f"this node reads the real kernel log ({KMSG}): a record written "
                          "there from userspace is stamped facility user, which gpuwarden "
                          f"ignores, so no drain can be rehearsed here; {setup}")
    if cfg.gpu_probe != "fake":
        raise InjectError(f'this node reads its GPUs through gpu_probe = "{cfg.gpu_probe}", not '
                          f"a test file: an Xid needs a fake GPU to name; {setup}")
    return FaultFiles(cfg.kernel_log, cfg.fake_gpu_file)


def check_text(text: str) -> None:
    """Refuse words that are not one printable line: a line break would start a record of its
    own (a second Xid, say one that drains, while the output names only the first)."""
    bad = next((ch for ch in text if not ch.isprintable()), None)
    if bad is not None:
        raise InjectError(f"--text {text!r}: {bad!r} is a control character or line break; "
                          "a record is one line: give the driver's words on one line, without "
                          "control characters")


def xid_line(code: int, bus_id: str, text: str, seq: int, usec: int) -> str:
    """One /dev/kmsg record as the driver logs an Xid: ``3,<seq>,<usec>,-;NVRM: Xid
    (PCI:0000:18:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.``"""
    check_text(text)
    m = _BUS_ID.match(bus_id.lower())
    if not m:
        raise InjectError(f"PCI bus id {bus_id!r}: expected domain:bus:device.function in hex, "
                          "as NVML gives it (00000000:3B:00.0)")
    domain, bus, dev = m.group(1)[-4:].rjust(4, "0"), m.group(2), m.group(3)
    return (f"{PRIORITY},{seq},{usec},-;NVRM: Xid (PCI:{domain}:{bus}:{dev}): {code}, "
            f"pid='<unknown>', name=<unknown>, {text}\n")


def default_text(code: int) -> str:
    if code in DRIVER_TEXT:
        return DRIVER_TEXT[code]
    return CATALOG[code][0] if code in CATALOG else "Unknown error"


def inject_xid(files: FaultFiles, code: int, gpu: int, text: str = "",
               usec: int | None = None) -> str:
    """Append an Xid for ``gpu`` to the test kernel log; the record written."""
    check_text(text)
    with _test_dir(files.fake_gpu_file) as gdir:
        gpus = _fake_gpus(gdir, files.fake_gpu_file)
    if gpus is None:
        raise InjectError(f"fake_gpu_file {files.fake_gpu_file} does not exist: write a healthy "
                          "one first with `gpuwarden health inject clear`")
    by_index = {g.index: g for g in gpus}
    if gpu not in by_index or not by_index[gpu].pci_bus_id:
        have = ", ".join(str(i) for i in sorted(by_index)) or "none"
        raise InjectError(f"GPU {gpu} is not in {files.fake_gpu_file} with a pci_bus_id "
                          f"(GPUs there: {have})")
    with _test_dir(files.kernel_log) as kdir:
        old = _fault_log(kdir, files.kernel_log)
        if usec is None:
            # kmsg stamps records with this boot's monotonic clock, which is what the prolog's
            # fast path compares them against.
            usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        line = xid_line(code, by_index[gpu].pci_bus_id, text or default_text(code),
                        _next_seq(old), usec)
        prefix = old if not old or old.endswith(b"\n") else old + b"\n"
        _replace(kdir, files.kernel_log, prefix + line.encode())
    return line.rstrip("\n")


def clear(files: FaultFiles, exp: Expected) -> list[str]:
    """Empty the test kernel log and write a healthy fake GPU file for this node's class.
    Both files are checked before either is written: each must be absent or a test file."""
    with _test_dir(files.kernel_log) as kdir, _test_dir(files.fake_gpu_file) as gdir:
        _fault_log(kdir, files.kernel_log)
        gpus = _fake_gpus(gdir, files.fake_gpu_file)
        count = exp.gpu_count or len(gpus or ()) or 8
        _replace(kdir, files.kernel_log, b"")
        _replace(gdir, files.fake_gpu_file, healthy_fake(
            count, nvlinks=exp.nvlink_links or 18,
            model=exp.gpu_model or "NVIDIA H100 80GB HBM3").encode())
    return [f"{files.kernel_log}: emptied (no Xid left)",
            f"{files.fake_gpu_file}: {count} healthy GPUs"]


def outcome(code: int, text: str = "") -> str:
    """What gpuwarden's policy does with this Xid, in words."""
    rule: Rule = xid_rule(code, text or default_text(code))
    if rule.action in DRAINS:
        times = "" if rule.threshold == 1 else f" once seen {rule.threshold} times in the window"
        return (f"xid {code} ({rule.what}): drains the node{times}"
                f"{rule.needs or SUFFIX.get(rule.action, '')}")
    return (f"xid {code} ({rule.what}): {rule.action.name.lower()}, no drain; to rehearse a "
            "drain use 79 (fallen off the bus) or 48 (double-bit ECC error)")


# ---- files ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _test_dir(path: str) -> Iterator[int]:
    """A descriptor of the directory holding the test file ``path``, reached from / one
    component at a time (install's walk): no link on the way, every directory above root's
    (or sticky), the last one root's alone. Reads and writes then go through it, so renaming a
    directory on the way after this check changes nothing."""
    directory, name = os.path.split(path)
    if not name or not os.path.isabs(path) or {".", ".."} & set(path.split("/")):
        raise InjectError(f"{path}: expected an absolute path to a file, without . or .. "
                          "(readlink -f gives one)")
    with contextlib.ExitStack() as stack:
        try:
            fd = stack.enter_context(opened_dir(directory, os.geteuid(), create=False))
        except InstallError as exc:
            # opened_dir words its refusal for install-files: keep the finding, say ours.
            problem = str(exc).split(": refusing to install", 1)[0]
            raise InjectError(f"{path}: {problem}; the test files must be in a directory only "
                              f"root can write, below directories only root can change (see "
                              f"{DOC})") from None
        except OSError as exc:
            raise InjectError(f"{directory}: cannot open it ({exc.strerror or exc})") from None
        if fd is None:
            raise InjectError(f"{directory} does not exist: create it (install -d -m 0755 "
                              f"{directory})")
        yield fd


def _fault_log(dir_fd: int, path: str) -> bytes:
    """The test kernel log's bytes; refused unless it is empty or holds only /dev/kmsg-format
    records: anything else is a real log, which gpuwarden must never write into."""
    data = _read_own(dir_fd, path) or b""
    text = data.decode("utf-8", errors="replace")
    recs = kernlog.parse(text, 0.0, time.time())
    other = sorted(recs.renderings - {"kmsg"})
    if other or recs.malformed:
        why = f"records in another rendering ({', '.join(other)})" if other else \
            f"lines that are no kernel record ({recs.malformed[0]})"
        raise InjectError(f"kernel_log {path} holds {why}: it looks like a real log, not a "
                          f"test file; point kernel_log at a file of its own (see {DOC})")
    return data


def _fake_gpus(dir_fd: int, path: str) -> tuple[GpuObs, ...] | None:
    """The GPUs the fake GPU file lists; None when absent. Refused unless it is one: a file
    that is not is something else, which gpuwarden must never replace."""
    data = _read_own(dir_fd, path)
    if data is None:
        return None
    try:
        doc = json.loads(data.decode("utf-8"))
        if isinstance(doc, dict):
            # Read for its GPUs only: a rehearsed hang must not stall the command undoing it.
            doc = {k: v for k, v in doc.items() if k not in ("hang", "init_error")}
        return parse_fake(json.dumps(doc), path).gpus
    except UnicodeDecodeError:
        why = "not UTF-8"
    except json.JSONDecodeError as exc:
        why = f"not JSON: {exc.msg} at line {exc.lineno}"
    except RecursionError:
        why = "JSON nested too deep"
    except ProbeError as exc:
        why = str(exc).removeprefix(f"{path}: ")
    raise InjectError(f"fake_gpu_file {path} is not a fake GPU file ({why}): refusing to "
                      f"replace it; if it is a test file, remove it (rm {path}) and run "
                      "`gpuwarden health inject clear`, else point fake_gpu_file at a file of "
                      f"its own (see {DOC})")


def _next_seq(data: bytes) -> int:
    seqs = [int(m.group(2)) for line in data.split(b"\n") if (m := _SEQ.match(line))]
    return max(seqs, default=0) + 1


def _read_own(dir_fd: int, path: str) -> bytes | None:
    """A file of ours alone in ``dir_fd``, never through a link or from a FIFO; None when
    absent."""
    try:
        data = read_own_at(dir_fd, os.path.basename(path), path, MAX_BYTES + 1)
    except StateDirError as exc:
        raise InjectError(str(exc)) from None
    except OSError as exc:
        raise InjectError(f"{path}: cannot open it ({exc.strerror}; a link?)") from None
    if data is None:
        return None
    if len(data) > MAX_BYTES:
        raise InjectError(f"{path}: larger than {MAX_BYTES >> 20} MiB, more than a test file "
                          f"holds: if it is one, remove it (rm {path}) and run `gpuwarden "
                          "health inject clear`")
    return data


def _replace(dir_fd: int, path: str, data: bytes) -> None:
    """Replace ``path`` whole (a new file renamed over it, in ``dir_fd``): readers see the old
    or the new file, and a link planted at the name is replaced, never followed."""
    try:
        write_at(dir_fd, os.path.basename(path), data, 0o644)
    except OSError as exc:
        raise InjectError(f"{path}: cannot write it ({exc.strerror or exc})") from None
