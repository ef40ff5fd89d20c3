"""Nested state through the Checkpointer: dicts, lists, tuples, int keys and Python scalars come
back bit for bit; a tree that does not fit its shards is a bad copy (restore walks back); a flat
numpy state is written exactly as before."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import nested
from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.codec import StateError
from gpuwarden.ckpt.fstier import FsTier


def optimizer_like(step: int) -> dict[str, Any]:
    return {
        "model": {"layer.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4) * step,
                  "layer.0.bias": np.zeros(0, dtype=np.float64)},
        "optim": {"state": {0: {"step": float(step), "exp_avg": np.ones(4, np.float32)},
                            1: {"step": float(step), "exp_avg": np.full(4, -0.0, np.float32)}},
                  "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "params": [0, 1],
                                    "amsgrad": False, "foreach": None, "name": "all"}]},
        "epoch": 2**70 + step,  # larger than any JSON double holds exactly
        "loss": float("nan"), "best": -0.0, "inf": float("-inf"), "tiny": 5e-324,
        "rng": b"\x00\xff" * 8, "np_scalar": np.float16(1.5),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray):
        return (isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
                and a.tobytes() == b.tobytes())
    if isinstance(a, float):
        return isinstance(b, float) and a.hex() == b.hex() if not math.isnan(a) else math.isnan(b)
    if isinstance(a, dict):
        return (isinstance(b, dict) and list(a) == list(b)
                and all(type(k) is type(k2) for k, k2 in zip(a, b, strict=True))
                and all(same(a[k], b[k]) for k in a))
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def test_nested_state_with_scalars_and_int_keys_restores_bit_identical(tmp_path: Path) -> None:
    shm = FsTier("shm", str(tmp_path / "shm"), "job-3")
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-3")
    ck = Checkpointer("job-3", shm, [fsx])
    ck.save(5, optimizer_like(5))
    assert ck.wait_durable(5, timeout=30)
    ck.close(timeout=30)
    got = Checkpointer("job-3", FsTier("shm", str(tmp_path / "none"), "job-3"), [fsx]).restore()
    assert got is not None and got.step == 5
    assert same(optimizer_like(5), got.state)
    assert got.state["optim"]["param_groups"][0]["betas"] == (0.9, 0.95)


def test_a_flat_numpy_state_is_written_as_before(tmp_path: Path) -> None:
    ck = Checkpointer("job-3", FsTier("shm", str(tmp_path / "shm"), "job-3"), [])
    m = ck.save(1, {"w": np.ones(3)})
    ck.close()
    assert [s.name for s in m.shards] == ["w"]
    with pytest.raises(StateError, match="reserved"):
        Checkpointer("job-3", FsTier("shm", str(tmp_path / "s2"), "job-3"), []).save(
            1, {nested.STRUCTURE: b"{}"})


@pytest.mark.parametrize(("value", "match"), [
    ({"a": {1.5: 1}}, "keys must be str or int"),
    ({"a": [object()]}, r"state \['a'\]\[0\]: builtins.object cannot be checkpointed"),
    ({"a": {True: 1}}, "keys must be str or int"),
])
def test_what_cannot_be_saved_is_named(value: dict[str, Any], match: str) -> None:
    with pytest.raises(StateError, match=match):
        nested.flatten(value)


def test_too_deep_a_state_is_refused() -> None:
    deep: Any = 1
    for _ in range(nested.MAX_DEPTH + 2):
        deep = [deep]
    with pytest.raises(StateError, match="deep"):
        nested.flatten({"x": deep})


def _tree(flat: dict[str, Any]) -> dict[str, Any]:
    return dict(json.loads(flat[nested.STRUCTURE]))


def _decoded(flat: dict[str, Any]) -> dict[str, Any]:
    """What restore decodes from the shards flatten wrote (bytes as bytes, arrays as arrays)."""
    return {k: bytes(v) if isinstance(v, (bytes, memoryview)) else v for k, v in flat.items()}


@pytest.mark.parametrize("damage", [
    lambda t: t.update(format="other/9"),
    lambda t: t["tree"]["dict"][0][1].update(ndarray="n999999"),
    lambda t: t["tree"]["dict"].append([["s", "b"], {"ndarray": "n000000"}]),
    lambda t: t["tree"]["dict"][0].__setitem__(0, ["x", "a"]),
    lambda t: t["tree"].update(dict=[[["i", "zz"], {"v": None}]]),
    lambda t: t.update(tree={"list": []}),
    lambda t: t.update(tree={"int": "1" * 5000}),
    lambda t: t["tree"]["dict"][1].__setitem__(1, {"float": "0xnope"}),
])
def test_a_tree_that_does_not_fit_its_shards_is_a_state_error(damage: Any) -> None:
    flat = nested.flatten({"a": np.ones(2), "f": 1.0})
    tree = _tree(flat)
    damage(tree)
    flat[nested.STRUCTURE] = json.dumps(tree).encode()
    with pytest.raises(StateError):
        nested.unflatten(_decoded(flat))


def test_a_shard_no_node_uses_is_refused() -> None:
    flat = nested.flatten({"a": np.ones(2)})
    flat["n000007"] = np.ones(1)
    with pytest.raises(StateError, match="belong to no node"):
        nested.unflatten(_decoded(flat))


def test_a_corrupt_tree_walks_back_to_the_previous_step(tmp_path: Path) -> None:
    """The tree is checksummed like any shard: a flipped byte there fails its check, and
    restore takes the older step."""
    shm = FsTier("shm", str(tmp_path / "shm"), "job-3")
    ck = Checkpointer("job-3", shm, [], keep=3)
    ck.save(1, optimizer_like(1))
    ck.save(2, optimizer_like(2))
    ck.close()
    step2 = next(p for p in (tmp_path / "shm").rglob(nested.STRUCTURE) if "000000000002" in str(p))
    raw = bytearray(step2.read_bytes())
    raw[10] ^= 0x01
    os.chmod(step2, 0o600)
    step2.write_bytes(bytes(raw))
    got = Checkpointer("job-3", FsTier("shm", str(tmp_path / "shm"), "job-3"), []).restore()
    assert got is not None and got.step == 1 and same(optimizer_like(1), got.state)


@pytest.mark.parametrize("node", [
    {"float": "0x1p99999"},                      # OverflowError in float.fromhex
    {"float": "0x1p" + "9" * 100},
])
def test_a_damaged_scalar_is_a_state_error_never_a_crash(node: dict[str, Any]) -> None:
    flat = nested.flatten({"f": 1.0})
    tree = _tree(flat)
    tree["tree"]["dict"][0][1] = node
    flat[nested.STRUCTURE] = json.dumps(tree).encode()
    with pytest.raises(StateError):
        nested.unflatten(_decoded(flat))


def test_a_tree_larger_than_any_save_writes_is_refused_before_parsing() -> None:
    flat = nested.flatten({"a": np.ones(2)})
    flat[nested.STRUCTURE] = b"[" * (nested.MAX_STRUCTURE + 1)
    with pytest.raises(StateError, match="at most"):
        nested.unflatten(_decoded(flat))


# ---- a second review (issue 15) -------------------------------------------------------------
def roundtrip(tmp_path: Path, state: dict[str, Any]) -> Any:
    """Saved to node memory and a shared tier, restored from the shared tier alone."""
    shm = FsTier("shm", str(tmp_path / "shm"), "job-9")
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-9")
    ck = Checkpointer("job-9", shm, [fsx])
    ck.save(1, state)
    assert ck.wait_durable(1, timeout=30)
    ck.close(timeout=30)
    got = Checkpointer("job-9", FsTier("shm", str(tmp_path / "none"), "job-9"), [fsx]).restore()
    assert got is not None and got.step == 1, "a state that saved must restore"
    return got.state


def test_large_python_values_that_save_also_restore(tmp_path: Path) -> None:
    # A loss history, a sampler's order and a long config string are kept inline in the tree:
    # they saved, became durable, and every restore refused the tree (a fresh start).
    state = {"losses": [float(i) / 7 for i in range(40_000)],
             "order": list(range(150_000)), "config": "x" * 1_100_000,
             "w": np.ones(4, np.float32)}
    assert same(state, roundtrip(tmp_path, state))


def test_a_tree_larger_than_any_restore_accepts_is_refused_at_save(tmp_path: Path) -> None:
    ck = Checkpointer("job-8", FsTier("shm", str(tmp_path / "shm"), "job-8"), [])
    with pytest.raises(StateError, match="as tensors or arrays"):
        ck.save(1, {"huge": "y" * (nested.MAX_STRUCTURE + 1)})
    ck.close(timeout=30)


def test_ints_of_any_size_and_nan_payloads_come_back_bit_for_bit(tmp_path: Path) -> None:
    import struct
    payload = struct.unpack("<d", struct.pack("<Q", 0xFFF8_0000_0000_0ABC))[0]
    big = 10 ** 4299
    state = {"neg": -(big * 9 + 1), "huge": 7 ** 20_000, "nan": payload,
             "scalars": [np.float64(2.5), np.int64(-3), np.bool_(True)]}
    got = roundtrip(tmp_path, state)
    assert got["neg"] == state["neg"] and got["huge"] == state["huge"]
    assert struct.pack("<d", got["nan"]) == struct.pack("<d", payload)
    assert [type(x) for x in got["scalars"]] == [np.float64, np.int64, np.bool_]


def test_a_huge_int_saved_without_a_digit_limit_still_restores(tmp_path: Path) -> None:
    import sys
    n = 3 ** 10_000  # 4,772 digits
    before = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # the saving process may run without Python's limit
    try:
        flat = nested.flatten({"n": n, "neg": -n})
    finally:
        sys.set_int_max_str_digits(before)
    got = nested.unflatten(_decoded(flat))
    assert got == {"n": n, "neg": -n}


@pytest.mark.parametrize("body", ["00 00 00 00 0000", "zzzzzzzzzzzzzzzz", "00000000000000F8"])
def test_a_damaged_float_s_bits_are_a_state_error(body: str) -> None:
    flat = nested.flatten({"f": float("nan")})
    tree = _tree(flat)
    tree["tree"]["dict"][0][1] = {"fbits": body}
    flat[nested.STRUCTURE] = json.dumps(tree).encode()
    with pytest.raises(StateError):
        nested.unflatten(_decoded(flat))


def test_an_int_key_too_large_for_text_is_refused_naming_it() -> None:
    with pytest.raises(StateError, match="int key"):
        nested.flatten({"d": {7 ** 20_000: 1}})
