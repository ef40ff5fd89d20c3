"""gpuwarden's action for every XID in NVIDIA's catalog, and for NVSwitch SXids. Pure.

Each code's action follows from the catalog's immediate-action bucket (BUCKET_ACTION) unless
OVERRIDES says otherwise, with the reason; docs/health.md lists both (policy_table_markdown).
Four codes are judged per line rather than per code: 94 (its RST:/D-RST: flags), 144-150 (the
NVLink5 decode), 154 (the recovery action it names) and every SXid (the severity it prints).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from gpuwarden.health import xidnvlink5
from gpuwarden.health.xidcatalog import CATALOG

POLICY_VERSION = "2026.12-1"


class Action(enum.IntEnum):
    """Ordered: a higher value is the stronger action."""

    IGNORE = 0
    WARN = 1
    DRAIN = 2   # drain; needs a person (reseat, inspect)
    RESET = 3   # drain until the GPU is reset (nvidia-smi -r or a reboot)
    REBOOT = 4  # drain until the node is rebooted


DRAINS = (Action.DRAIN, Action.RESET, Action.REBOOT)
SUFFIX = {Action.RESET: ", needs GPU reset", Action.REBOOT: ", needs node reboot"}


@dataclass(frozen=True)
class Rule:
    action: Action
    threshold: int  # occurrences within the window before the action applies
    what: str
    catalog: str = ""  # NVIDIA's immediate action ("" when the catalog gives none)
    needs: str = ""  # what clears it, where SUFFIX[action] would not say it right


BUCKET_ACTION: dict[str, Action] = {
    "RESET_GPU": Action.RESET,
    "RESTART_BM": Action.REBOOT,
    "RESTART_VM": Action.REBOOT,  # the VM is the node gpuwarden runs in
    "WORKFLOW_XID_48": Action.RESET,  # solo: reset; with 63/64: drain and reset
    "WORKFLOW_NVLINK_ERR": Action.RESET,  # the catalog: a GPU reset or reboot clears it
    "WORKFLOW_NVLINK5_ERR": Action.WARN,  # decoded per line; WARN only when undecodable
    "XID_154": Action.WARN,  # decoded per line
    "CHECK_MECHANICALS": Action.DRAIN,
    "CONTACT_SUPPORT": Action.WARN,
    "UPDATE_SWFW": Action.WARN,
    "RESTART_APP": Action.IGNORE,
    "WORKFLOW_XID_45": Action.IGNORE,
    "IGNORE": Action.IGNORE,
    "": Action.WARN,
}

# Where gpuwarden deliberately differs from the catalog's bucket, and why.
OVERRIDES: dict[int, tuple[Action, int, str]] = {
    61: (Action.RESET, 1, "pre-Ampere GPUs still print it for a micro-controller breakpoint; "
                          "the catalog lists it as unused on A100 and later"),
    92: (Action.DRAIN, 20, "a burst of corrected single-bit errors precedes double-bit ones; "
                           "20 in the window drain, fewer only warn"),
    94: (Action.WARN, 1, "read per line: RST: Yes or D-RST: Yes needs a reset, otherwise only "
                         "the application restarts"),
    159: (Action.RESET, 1, "the catalog resets when UVM is in use, which every CUDA job on a "
                           "C2C-attached GPU is; gpuwarden cannot tell, so it resets"),
    162: (Action.IGNORE, 1, "no bucket yet; the capability came back, nothing to do"),
    167: (Action.RESET, 1, "no bucket yet; a fatal PCIe timeout loses the GPU until a reset"),
    169: (Action.RESET, 1, "no bucket yet; a halted micro-controller, like 62"),
    171: (Action.RESET, 1, "no bucket yet; an uncorrectable DRAM error, detail of 48"),
    172: (Action.RESET, 1, "no bucket yet; an uncorrectable SRAM error, detail of 48"),
}


def _rule(code: int) -> Rule:
    mnemonic, bucket = CATALOG[code]
    what = mnemonic.lower().replace("_", " ")
    if code in OVERRIDES:
        action, threshold, _why = OVERRIDES[code]
        return Rule(action, threshold, what, bucket)
    return Rule(BUCKET_ACTION[bucket], 1, what, bucket)


POLICY: dict[int, Rule] = {code: _rule(code) for code in CATALOG}
UNKNOWN_RULE = Rule(Action.WARN, 1, "XID not in gpuwarden's policy table")

# The driver ends a 94/95 record with its own flags, after the process name (which a user
# chooses): only flags at the very end are the driver's. Older drivers print none.
_RST = re.compile(r"\bRST: *(Yes|No)(?:, *D-RST: *(Yes|No))?[ .]*\Z", re.IGNORECASE)
# Anchored, bounded pieces: linear in the line's length whatever a line holds.
_RECOVERY = re.compile(r" *GPU recovery action changed from 0x[0-9a-fA-F]{1,8} *\([^)]{0,64}\) "
                       r"to (0x[0-9a-fA-F]{1,8})(?: *\(([^)]{0,64})\))?", re.IGNORECASE)
# NVML's nvmlDeviceGpuRecoveryAction_t: the number decides, the words differ between drivers
# ("Node Reboot Required", "OS Reboot", "PF FLR"). A code NVML does not list yet drains.
_RECOVERY_ACTION = {0: Action.IGNORE, 1: Action.RESET, 2: Action.REBOOT, 3: Action.WARN,
                    4: Action.RESET}


def xid_rule(code: int, text: str) -> Rule:
    """The rule for one Xid record, ``text`` being what follows ``<code>,`` in it."""
    base = POLICY.get(code, UNKNOWN_RULE)
    if code == 94:
        return _rule_94(text, base)
    if code == 154:
        return _rule_154(text, base)
    if 144 <= code <= 150:
        return _rule_nvlink5(code, text, base)
    return base


def _rule_94(text: str, base: Rule) -> Rule:
    m = _RST.search(text[-64:])  # the flags are the record's last few characters
    if m is None:
        return base
    rst, drst = m.group(1).lower() == "yes", (m.group(2) or "").lower() == "yes"
    if rst or drst:
        which = "RST" if rst else "D-RST"
        return Rule(Action.RESET, 1, f"contained error, {which}: Yes", base.catalog)
    return base


def _rule_154(text: str, base: Rule) -> Rule:
    m = _RECOVERY.match(text)
    if not m:
        return base
    code = int(m.group(1), 16)
    action = _RECOVERY_ACTION.get(code, Action.RESET)
    name = (m.group(2) or "").strip() or "not named"
    return Rule(action, 1, f"GPU recovery action {code:#x} ({name})", base.catalog)


def _rule_nvlink5(code: int, text: str, base: Rule) -> Rule:
    bucket, what = xidnvlink5.decode(code, text)
    if not bucket:
        return Rule(Action.WARN, 1, what, base.catalog)
    action = {xidnvlink5.RESET: Action.RESET, xidnvlink5.IGNORE: Action.IGNORE}.get(
        bucket, Action.WARN)
    return Rule(action, 1, what, bucket)


def sxid_rule(code: int, severity: str) -> Rule:
    """An NVSwitch SXid, judged by the severity the driver printed with it.

    The Fabric Manager guide classes every SXid fatal or non-fatal and the driver prints that
    class in the record, so the record is the table: a fatal SXid needs the GPUs and NVSwitches
    of the fabric reset; a non-fatal one is informational.
    """
    if severity.lower() == "fatal":
        return Rule(Action.RESET, 1, "fatal NVSwitch error", "fatal",
                    ", needs GPU and NVSwitch reset")
    if severity.lower() in ("non-fatal", "nonfatal"):
        return Rule(Action.IGNORE, 1, "non-fatal NVSwitch error", "non-fatal")
    return Rule(Action.WARN, 1, f"NVSwitch SXid {code} without its severity", "")


def policy_table_markdown() -> str:
    """docs/health.md's table: consecutive codes with the same catalog and gpuwarden actions merge."""
    rows: list[tuple[int, int, str, str]] = []
    for code in sorted(POLICY):
        rule = POLICY[code]
        ours = _describe(code, rule)
        catalog = rule.catalog or "(none)"
        if rows and rows[-1][1] == code - 1 and rows[-1][2:] == (catalog, ours):
            rows[-1] = (rows[-1][0], code, catalog, ours)
        else:
            rows.append((code, code, catalog, ours))
    lines = ["| XID | NVIDIA catalog (immediate action) | gpuwarden |", "|---|---|---|"]
    for lo, hi, catalog, ours in rows:
        codes = str(lo) if lo == hi else f"{lo}-{hi}"
        lines.append(f"| {codes} | {catalog} | {ours} |")
    return "\n".join(lines)


def _describe(code: int, rule: Rule) -> str:
    if code == 94:
        return "drain for reset when the line says RST: Yes or D-RST: Yes, else warn"
    if code == 154:
        return ("the recovery action code it names (NVML enum): 1 GPU reset and 4 drain and reset "
                "drain for reset, 2 node reboot for reboot, 3 drain P2P warns, 0 clears, any "
                "other nonzero drains for reset")
    if 144 <= code <= 150:
        return "NVLink5 decode: drain for reset where the decode says RESET_GPU"
    words = {Action.IGNORE: "ignore", Action.WARN: "warn", Action.DRAIN: "drain",
             Action.RESET: "drain until GPU reset", Action.REBOOT: "drain until node reboot"}
    text = words[rule.action]
    if rule.threshold > 1:
        text += f" after {rule.threshold} in the window"
    return text + (" (differs)" if code in OVERRIDES else "")
