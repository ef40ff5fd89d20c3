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

_RST = re.compile(r"\b(D-RST|RST): *(Yes|No)\b", re.IGNORECASE)
_RECOVERY = re.compile(r"recovery action changed from .*? to (0x[0-9a-fA-F]+) *\(([^)]*)\)")
_RECOVERY_ACTION = {
    "none": Action.IGNORE, "drain p2p": Action.WARN, "drain and reset": Action.RESET,
    "gpu reset required": Action.RESET, "node reboot required": Action.REBOOT,
}


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
    flags = {k.upper(): v.lower() == "yes" for k, v in _RST.findall(text)}
    if flags.get("RST") or flags.get("D-RST"):
        which = "RST" if flags.get("RST") else "D-RST"
        return Rule(Action.RESET, 1, f"contained error, {which}: Yes", base.catalog)
    return base


def _rule_154(text: str, base: Rule) -> Rule:
    m = _RECOVERY.search(text)
    if not m:
        return base
    action = _RECOVERY_ACTION.get(m.group(2).strip().lower(), Action.WARN)
    return Rule(action, 1, f"GPU recovery action: {m.group(2).strip()}", base.catalog)


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
        return Rule(Action.RESET, 1, "fatal NVSwitch error, needs GPU and NVSwitch reset", "fatal")
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
        return "the recovery action it names: reset/drain-and-reset drain for reset, reboot for reboot"
    if 144 <= code <= 150:
        return "NVLink5 decode: drain for reset where the decode says RESET_GPU"
    words = {Action.IGNORE: "ignore", Action.WARN: "warn", Action.DRAIN: "drain",
             Action.RESET: "drain until GPU reset", Action.REBOOT: "drain until node reboot"}
    text = words[rule.action]
    if rule.threshold > 1:
        text += f" after {rule.threshold} in the window"
    return text + (" (differs)" if code in OVERRIDES else "")
