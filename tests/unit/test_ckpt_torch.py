"""PyTorch state through gpuwarden's checkpoints, with real torch: a model's and an optimizer's
state_dict save and restore bit for bit, training resumes exactly where it stopped, every torch
dtype survives, and a contiguous CPU tensor is written without a copy."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuwarden.ckpt import nested
from gpuwarden.ckpt.checkpointer import Checkpointer
from gpuwarden.ckpt.codec import StateError
from gpuwarden.ckpt.fstier import FsTier
from tests.torchreq import torch

nn = torch.nn


def model_and_optimizer(seed: int) -> tuple[Any, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))
    model.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, opt


def train(model: Any, opt: Any, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.steps_seen += 1


def raw(t: Any) -> list[int]:
    """A tensor's bytes, whatever its dtype or shape."""
    return [] if t.numel() == 0 else t.contiguous().reshape(-1).view(torch.uint8).tolist()


def tensors_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and raw(a) == raw(b))
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(
            tensors_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(tensors_equal, a, b))
    return bool(type(a) is type(b) and a == b)


def test_training_resumes_bit_identical_from_a_restored_state_dict(tmp_path: Path) -> None:
    model, opt = model_and_optimizer(0)
    train(model, opt, 5, seed=1)
    shm = FsTier("shm", str(tmp_path / "shm"), "job-1")
    fsx = FsTier("fsx", str(tmp_path / "fsx"), "job-1")
    ck = Checkpointer("job-1", shm, [fsx])
    ck.save(5, {"model": model.state_dict(), "optim": opt.state_dict(), "epoch": 1})
    assert ck.wait_durable(5, timeout=30)
    ck.close(timeout=30)
    train(model, opt, 3, seed=2)  # the uninterrupted run goes on

    got = Checkpointer("job-1", FsTier("shm", str(tmp_path / "gone"), "job-1"), [fsx]).restore()
    assert got is not None and got.step == 5 and got.state["epoch"] == 1
    model2, opt2 = model_and_optimizer(99)  # different initial weights: all must come back
    model2.load_state_dict(got.state["model"])
    opt2.load_state_dict(got.state["optim"])
    train(model2, opt2, 3, seed=2)
    assert tensors_equal(model.state_dict(), model2.state_dict())
    assert tensors_equal(opt.state_dict(), opt2.state_dict())


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8,
          torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64,
          *(d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None))
            if d is not None)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_and_shape_survives(tmp_path: Path, dtype: Any) -> None:
    g = torch.Generator().manual_seed(7)
    base = torch.randn(6, 5, generator=g, dtype=torch.float64) * 100
    full = base.to(dtype) if dtype != torch.bool else base > 0
    state = {"full": full, "scalar": full[2, 3].clone(), "empty": full[:0],
             "strided": full.t(), "slice": full[1:4, ::2]}
    ck = Checkpointer("job-1", FsTier("shm", str(tmp_path / "shm"), "job-1"), [])
    ck.save(1, state)
    got = ck.restore()
    ck.close()
    assert got is not None
    for k, v in state.items():
        back = got.state[k]
        assert back.dtype == v.dtype and back.shape == v.shape and raw(back) == raw(v), k
        if back.numel():
            back.reshape(-1).view(torch.uint8).add_(0)  # the caller's own, writable


def test_a_contiguous_cpu_tensor_is_written_from_its_own_memory() -> None:
    t = torch.arange(1024, dtype=torch.float32)
    flat = nested.flatten({"w": t})
    arr = flat["n000000"]
    assert isinstance(arr, np.ndarray) and arr.ctypes.data == t.data_ptr()


def test_sparse_tensors_are_refused_with_the_way_out() -> None:
    sparse = torch.eye(3).to_sparse()
    with pytest.raises(StateError, match="to_dense"):
        nested.flatten({"w": sparse})


def test_a_tree_naming_a_dtype_torch_lacks_is_a_bad_copy() -> None:
    flat = nested.flatten({"w": torch.ones(2)})
    flat[nested.STRUCTURE] = flat[nested.STRUCTURE].replace(b'"float32"', b'"Tensor"')
    with pytest.raises(StateError, match="not a torch dtype"):
        nested.unflatten({k: bytes(v) if isinstance(v, bytes) else v for k, v in flat.items()})
    flat = nested.flatten({"w": torch.ones(2)})
    flat[nested.STRUCTURE] = flat[nested.STRUCTURE].replace(b'"shape":[2]', b'"shape":[3]')
    with pytest.raises(StateError, match="8 bytes"):
        nested.unflatten(flat)


@pytest.mark.parametrize("shape", [[0, 2**64], [0, 2**62, 2**62], [-1], [2**40, 2**40]])
def test_a_tree_with_an_impossible_shape_is_a_bad_copy(shape: list[int]) -> None:
    flat = nested.flatten({"w": torch.ones(0, 3)})
    flat[nested.STRUCTURE] = flat[nested.STRUCTURE].replace(
        b'"shape":[0,3]', b'"shape":' + json.dumps(shape).encode())
    with pytest.raises(StateError):
        nested.unflatten(flat)


def test_a_dtype_name_never_makes_torch_import_anything() -> None:
    flat = nested.flatten({"w": torch.ones(2)})
    flat[nested.STRUCTURE] = flat[nested.STRUCTURE].replace(b'"float32"', b'"_dynamo"')
    before = set(sys.modules)
    with pytest.raises(StateError, match="not a torch dtype"):
        nested.unflatten(flat)
    assert set(sys.modules) == before


@pytest.mark.parametrize(("make", "match"), [
    (lambda: torch.quantize_per_tensor(torch.ones(4), 0.5, 3, torch.qint8), "quantized"),
    (lambda: torch.ones(3, device="meta"), "meta"),
    (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
])
def test_tensors_whose_bytes_are_not_their_value_are_refused(make: Any, match: str) -> None:
    with pytest.raises(StateError, match=match):
        nested.flatten({"w": make()})


def test_lazy_conjugate_and_negative_views_save_their_values(tmp_path: Path) -> None:
    z = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    ck = Checkpointer("job-1", FsTier("shm", str(tmp_path / "shm"), "job-1"), [])
    ck.save(1, {"conj": z.conj(), "neg": torch._neg_view(torch.ones(3))})
    got = ck.restore()
    ck.close()
    assert got is not None
    assert torch.equal(got.state["conj"], torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))
    assert torch.equal(got.state["neg"], -torch.ones(3))


# ---- a second review (issue 15) -------------------------------------------------------------
def test_one_element_views_with_a_parents_stride_save_their_value(tmp_path: Path) -> None:
    # `.contiguous()` is a no-op on them (one element counts as contiguous), and reading
    # their memory as bytes failed with a raw RuntimeError.
    base = torch.randn(3, 4, dtype=torch.float32)
    state = {"col": base[:1, 1], "imag": torch.randn(1, 3, dtype=torch.complex64)[:, 1].imag,
             "one": base[2:3, 3:4]}
    shm = FsTier("shm", str(tmp_path / "shm"), "job-5")
    ck = Checkpointer("job-5", shm, [])
    ck.save(1, state)
    got = ck.restore()
    ck.close(timeout=30)
    assert got is not None
    for k, v in state.items():
        assert got.state[k].shape == v.shape and torch.equal(got.state[k], v), k


def test_a_tensor_subclass_is_refused_with_the_way_to_dcp() -> None:
    class Sub(torch.Tensor):
        pass

    Sub.__module__ = "torch.distributed.tensor._api"  # where DTensor lives
    sub = torch.ones(2).as_subclass(Sub)
    with pytest.raises(StateError, match=r"state \['w'\]: a Sub .*dcp_writer"):
        nested.flatten({"w": sub})
    # nn.Parameter is no subclass to refuse: it is a model's own tensor.
    assert nested.STRUCTURE in nested.flatten({"p": torch.nn.Parameter(torch.ones(2))})
