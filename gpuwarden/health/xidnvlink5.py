"""Decode NVLink5 XIDs 144-150 into NVIDIA's catalog action for that exact error. Pure.

The driver prints ``<unit> <Fatal|Nonfatal> XC<n> i<n> Link <n> (<intrInfo> <errorStatus> ...)``.
NVIDIA's "XID 144-150 Decode" table gives the action per (unit, errorStatus); for 149's link
events the action depends on the link-down reason in intrInfo bits 25:20. Anything the table
does not list falls back on the severity word the driver printed in the same line.
"""

from __future__ import annotations

import re

RESET = "RESET_GPU"
IGNORE = "IGNORE"
EVAL_154 = "XID_154_EVAL"  # the catalog: follow the Xid 154 that comes with it, else restart the app

# Matched at the start of what follows "<code>," (the driver prints the unit first), every
# piece bounded: linear in the line's length, and no text further on can pose as the unit.
_LINE = re.compile(
    r" {0,8}(?P<unit>[A-Z][A-Z0-9_]{0,63}(?:/[A-Z][A-Z0-9_]{0,63})?) {1,8}"
    r"(?P<sev>Fatal|Non-?fatal)\b[^(\[]{0,200}"
    r"[(\[](?P<regs>0x[0-9a-fA-F]{1,8}(?:[ ,]{1,4}0x[0-9a-fA-F]{1,8}){0,15}) {0,4}[)\]]",
    re.IGNORECASE)

# Newer drivers (R575+) renamed some units; the catalog lists both names as "old/new".
_ALIASES = {
    "NETIR_LINK_DOWN": "NETIR_LINK_EVT", "NETIR_INT": "NETIR", "NVLPW": "NVLPW_CTRL",
    "TLW_RX_PIPE0": "TLW_RX", "TLW_RX_PIPE1": "TLW_RX", "TLW_TX_PIPE0": "TLW_TX",
    "TLW_TX_PIPE1": "TLW_TX", "MSE_DEGRADED": "MSE", "MSE_WATCHDOG": "MSE",
}
_SW = 0x80000000  # software-reported status: the catalog ignores it for every unit
_TLW = {0x1: IGNORE, 0x2: IGNORE, 0x4: RESET, _SW: IGNORE}
_STATUS: dict[tuple[int, str], dict[int, str]] = {
    (144, "SAW_MVB"): {0x1: IGNORE, 0x2: RESET, 0x4: IGNORE, 0x8: IGNORE, 0x10: RESET, 0x20: IGNORE},
    (145, "RLW_CTRL"): {_SW: IGNORE},
    (145, "RLW_REMAP"): {**dict.fromkeys((0x1, 0x2, 0x4, 0x8, 0x10, 0x20), EVAL_154),
                         0x40: RESET, 0x80: RESET, 0x100: IGNORE, 0x200: IGNORE, _SW: IGNORE},
    (145, "RLW_RSPCOL"): {0x1: IGNORE, 0x2: RESET, _SW: IGNORE},
    (145, "RLW_RXPIPE"): {0x8: IGNORE, _SW: IGNORE},  # 0x1/0x2/0x4: see _rxpipe
    (145, "RLW_SRC_TRACK"): {0x1: RESET, 0x2: IGNORE, 0x4: EVAL_154, 0x8: EVAL_154, 0x10: RESET,
                             0x20: RESET, _SW: IGNORE},
    (145, "RLW_TAGSTATE"): {0x1: IGNORE, 0x2: RESET, 0x10000: IGNORE, 0x20000: RESET,
                            0x100000: RESET, _SW: IGNORE},
    (146, "TLW_CTRL"): _TLW, (146, "TLW_RX"): _TLW, (146, "TLW_TX"): _TLW,
    (147, "TREX"): {0x1: IGNORE, _SW: IGNORE},
    (148, "NVLPW_CTRL"): {_SW: IGNORE},
    (149, "NETIR_BER_EVENT"): dict.fromkeys((0x0, 0x1, 0x2, 0x3), IGNORE),
    (149, "NETIR_MFDE_EVENT"): {0x1: RESET, 0x3: IGNORE, 0x4: RESET, 0x5: RESET, 0x7: RESET},
}
_ANY_STATUS_RESET = {(149, "NETIR"), (150, "MSE")}
# 149 NETIR_LINK_EVT: link-down reason (intrInfo bits 25:20) -> action.
_LINK_DOWN_IGNORED = {0b100110, 0b101000}
_LINK_DOWN_RESET = {0, 1, 2, 4, 10, 15, 16, 17, 18, 21, 22, 32, 33, 34, 35, 36, 37, 42, 43}


def decode(xid: int, text: str) -> tuple[str, str]:
    """(catalog action, what) for one 144-150 line; "" when the line does not say."""
    m = _LINE.match(text)
    if not m:
        return "", "NVLink5 error the driver printed without its registers"
    unit = m.group("unit").upper().split("/")[0]
    unit = _ALIASES.get(unit, unit)
    regs = [int(r, 16) for r in re.split(r"[ ,]+", m.group("regs").strip())]
    intr, status = regs[0], (regs[1] if len(regs) > 1 else None)
    fatal_word = RESET if m.group("sev").lower() == "fatal" else IGNORE
    what = f"NVLink5 {unit} {m.group('sev')} (intrInfo {intr:#010x}"
    what += f", status {status:#x})" if status is not None else ")"
    if (xid, unit) == (149, "NETIR_LINK_EVT"):
        what += f" link-down reason {(intr >> 20) & 0x3F}"
    return _action(xid, unit, intr, status, fatal_word), what


def _action(xid: int, unit: str, intr: int, status: int | None, fatal_word: str) -> str:
    if (xid, unit) in _ANY_STATUS_RESET:
        return RESET
    if (xid, unit) == (149, "NETIR_LINK_EVT"):
        reason = (intr >> 20) & 0x3F
        if reason in _LINK_DOWN_IGNORED:
            return IGNORE
        return RESET if reason in _LINK_DOWN_RESET else fatal_word
    if status is None:
        return fatal_word
    if (xid, unit) == (145, "RLW_RXPIPE") and status in (0x1, 0x2, 0x4):
        return _rxpipe(intr)
    return _STATUS.get((xid, unit), {}).get(status, fatal_word)


def _rxpipe(intr: int) -> str:
    # The catalog's "action 2": one extra intrInfo bit asks for a reset, bit 10 in the pre-R575
    # layout (unit in bits 9:5, whose low bits read 0x0C2) and bit 7 in the R575 layout.
    bit = 10 if intr & 0x3FF == 0x0C2 else 7
    return RESET if intr >> bit & 1 else IGNORE
