"""Nested state (a PyTorch ``state_dict``, an optimizer's, dicts and lists of them, Python
scalars) flattened into the flat shards the codec writes, and built back bit for bit.

Every leaf array becomes one shard named by its position (``n000000``...: a state_dict key can
be any string, a shard name cannot), and one more shard, ``_nested.json``, records the tree:
containers, keys (str or int, as optimizers use), scalars (floats as ``float.hex`` so NaN, -0.0
and every bit survive) and, for each tensor, its torch dtype and shape. A tensor's bytes go as a
flat uint8 view of its memory: no copy for a contiguous CPU tensor, and every torch dtype
(bfloat16, float8 ...) survives, which NumPy could not hold. A CUDA tensor is first copied into
pinned host memory (all of them, then one synchronize).

torch is imported only when the state holds a tensor, so numpy-only jobs never need it. The
tree is read back as untrusted input: its size, depth, dtypes, shapes and shard references are
checked, and anything wrong is a StateError naming what (restore then walks back to an older
copy). Tensors sharing storage (tied weights) are saved once each and come back unshared;
`load_state_dict` copies into the model's own parameters either way.
"""

from __future__ import annotations

import functools
import json
import math
import re
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np

from gpuwarden.ckpt.codec import StateError
from gpuwarden.core import safejson

# Public (the package's docstring): for state a job saves or loads some other way.
__all__ = ["Later", "flatten", "is_flat", "is_nested", "unflatten"]

STRUCTURE = "_nested.json"
FORMAT = "gpuwarden.nested/1"
# The tree (Python scalars and strings inline) at most: save refuses more, so that every tree
# a save writes is one a restore accepts; a parse of this much stays within a few hundred MB.
MAX_STRUCTURE = 16 << 20
MAX_DEPTH = 64
_HEX16 = re.compile(r"[0-9a-f]{16}")


class Later:
    """A bytes leaf given after the rest of the step is written (`Checkpointer.begin`): DCP's
    metadata, which exists only once every rank has written its items."""

    def __init__(self) -> None:
        self.value: bytes | None = None

    def set(self, value: bytes) -> None:
        self.value = bytes(value)


def is_flat(state: Mapping[str, Any]) -> bool:
    """A state the codec takes as it is: str keys, bytes or NumPy values (the numpy-only API)."""
    return all(isinstance(k, str) and isinstance(v, (bytes, bytearray, memoryview, np.ndarray))
               for k, v in state.items())


def _is_tensor(value: Any) -> bool:
    # Checked by module name first so that numpy-only jobs never import torch.
    if not type(value).__module__.startswith("torch"):
        return False
    import torch  # noqa: PLC0415

    return isinstance(value, torch.Tensor)


class _Flattener:
    def __init__(self) -> None:
        self.shards: dict[str, Any] = {}
        self.cuda: list[tuple[str, Any, Any]] = []  # (shard, pinned host tensor, shape)

    def _shard(self) -> str:
        return f"n{len(self.shards):06d}"

    def leaf_tensor(self, value: Any, path: str) -> dict[str, Any]:
        import torch  # noqa: PLC0415

        t = value.detach()
        if type(t) is not torch.Tensor:  # nn.Parameter detaches to a Tensor; DTensor does not
            raise StateError(f"state {path}: a {type(t).__name__} (a tensor subclass) cannot "
                             "be saved with ck.save: sharded state (DTensor, FSDP) goes "
                             "through DCP: dcp.save(sd, storage_writer=dcp_writer(ck, step))")
        if t.is_sparse or t.layout != torch.strided:
            raise StateError(f"state {path}: {t.layout} tensors are not supported; save "
                             "t.to_dense()")
        if t.is_quantized:
            # Their bytes alone lose the scale and zero point: refused, never half-saved.
            raise StateError(f"state {path}: quantized tensors are not supported; save "
                             "t.int_repr(), t.q_scale() and t.q_zero_point()")
        if getattr(t, "is_nested", False):
            raise StateError(f"state {path}: nested tensors are not supported; save "
                             "t.unbind() as a list")
        if t.device.type not in ("cpu", "cuda"):
            raise StateError(f"state {path}: a tensor on {t.device} cannot be saved; move it "
                             "to the CPU or a GPU first")
        if _dtype_name(t.dtype) not in _dtypes():
            raise StateError(f"state {path}: dtype {t.dtype} is not supported")
        t = t.resolve_conj().resolve_neg()  # lazy conjugate/negative views: their values
        name = self._shard()
        node = {"tensor": name, "dtype": _dtype_name(t.dtype), "shape": list(t.shape)}
        if t.device.type == "cpu":
            try:
                self.shards[name] = _bytes_of(t.contiguous())
            except RuntimeError as exc:
                raise StateError(f"state {path}: cannot read the tensor's memory: "
                                 f"{str(exc)[:200]}") from None
        else:
            host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            host.copy_(t, non_blocking=True)
            self.shards[name] = None  # filled after the one synchronize
            self.cuda.append((name, host, t.device))
        return node

    def walk(self, value: Any, path: str, depth: int) -> Any:  # noqa: PLR0911 - one per kind
        if depth > MAX_DEPTH:
            raise StateError(f"state {path}: nested more than {MAX_DEPTH} deep")
        if value is None or isinstance(value, bool):
            return {"v": value}
        if isinstance(value, np.generic):  # before float: np.float64 is one, and stays itself
            name = self._shard()
            self.shards[name] = np.asarray(value)
            return {"npscalar": name}
        if isinstance(value, int):
            return _int_node(int(value))
        if isinstance(value, float):
            return _float_node(float(value))
        if isinstance(value, str):
            return {"str": value}
        if isinstance(value, (bytes, bytearray, memoryview)):
            name = self._shard()
            self.shards[name] = memoryview(value).cast("B")
            return {"bytes": name}
        if isinstance(value, Later):  # its shard's bytes come at the commit
            name = self._shard()
            self.shards[name] = value
            return {"bytes": name}
        if isinstance(value, np.ndarray):
            name = self._shard()
            self.shards[name] = value
            return {"ndarray": name}
        if _is_tensor(value):
            return self.leaf_tensor(value, path)
        if isinstance(value, Mapping):
            items = []
            for k, v in value.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise StateError(f"state {path}: key {k!r}: keys must be str or int")
                if isinstance(k, int) and k.bit_length() > INT_DIGITS * 3:
                    raise StateError(f"state {path}: an int key of {k.bit_length()} bits: "
                                     "keys must have at most 3,884 digits")
                key = ["s", k] if isinstance(k, str) else ["i", str(k)]
                items.append([key, self.walk(v, f"{path}[{k!r}]", depth + 1)])
            return {"dict": items}
        if isinstance(value, (list, tuple)):
            kind = "list" if isinstance(value, list) else "tuple"
            return {kind: [self.walk(v, f"{path}[{i}]", depth + 1) for i, v in enumerate(value)]}
        raise StateError(f"state {path}: {type(value).__module__}.{type(value).__name__} "
                         "cannot be checkpointed (tensors, arrays, bytes, str, int, float, "
                         "bool, None, and dicts, lists and tuples of them can)")


# Python's default limit on decimal conversion: what a restore reads in decimal, whatever
# limit the saving process ran with (PYTHONINTMAXSTRDIGITS, sys.set_int_max_str_digits).
INT_DIGITS = 4300


def _int_node(n: int) -> dict[str, str]:
    """As text, of any size (JSON readers may round large numbers): decimal up to
    INT_DIGITS digits, past it in hex, which has no limit."""
    try:
        text = str(n)
    except ValueError:  # past this process's limit
        return {"hexint": hex(n)}
    return {"int": text} if len(text.lstrip("-")) <= INT_DIGITS else {"hexint": hex(n)}


def _float_node(x: float) -> dict[str, str]:
    """float.hex is exact but for a NaN's sign and payload: those keep their 8 bytes."""
    if math.isnan(x):
        return {"fbits": struct.pack("<d", x).hex()}
    return {"float": x.hex()}


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


@functools.cache
def _dtypes() -> dict[str, Any]:
    """The torch dtypes a tensor can be saved and rebuilt with from its bytes alone, by name:
    read from the module's own attributes (a name from a checkpoint never makes torch import
    anything), quantized dtypes left out (their scale is not in the bytes)."""
    import torch  # noqa: PLC0415

    return {name: v for name, v in vars(torch).items()
            if isinstance(v, torch.dtype) and _dtype_name(v) == name
            and not name.startswith(("qint", "quint"))}


def _bytes_of(t: Any) -> np.ndarray[Any, Any]:
    """The tensor's memory as a flat uint8 array, sharing it (no copy when contiguous)."""
    import torch  # noqa: PLC0415

    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    if flat.stride(0) != 1:
        # A one-element view keeps its parent's stride and counts as contiguous: copied.
        flat = flat.clone(memory_format=torch.contiguous_format)
    out: np.ndarray[Any, Any] = (flat.view(torch.uint8) if flat.dtype != torch.uint8
                                 else flat).numpy()
    return out


def flatten(state: Mapping[str, Any]) -> dict[str, Any]:
    """The flat mapping the codec writes: the leaves' shards and the tree's."""
    f = _Flattener()
    tree = f.walk(state, "", 0)
    if f.cuda:
        import torch  # noqa: PLC0415

        for device in {d for _, _, d in f.cuda}:
            torch.cuda.synchronize(device)
        for name, host, _ in f.cuda:
            f.shards[name] = _bytes_of(host)
    doc = json.dumps({"format": FORMAT, "tree": tree}, separators=(",", ":"),
                     allow_nan=False).encode()
    if len(doc) > MAX_STRUCTURE:
        raise StateError(f"state: its Python values (ints, floats, strings, lists of them) "
                         f"take {len(doc)} bytes as text, more than {MAX_STRUCTURE} a restore "
                         "reads: save long lists and strings as tensors or arrays (or bytes)")
    return {**f.shards, STRUCTURE: doc}


# ---- back ----------------------------------------------------------------------------------
class _Builder:
    def __init__(self, shards: Mapping[str, Any]) -> None:
        self.shards = shards
        self.used: set[str] = set()

    def take(self, name: Any, kind: str) -> Any:
        if not isinstance(name, str) or name == STRUCTURE or name not in self.shards:
            raise StateError(f"{STRUCTURE}: {kind} refers to a shard {name!r} the step lacks")
        if name in self.used:
            raise StateError(f"{STRUCTURE}: shard {name!r} is referred to twice")
        self.used.add(name)
        return self.shards[name]

    def tensor(self, node: Mapping[str, Any]) -> Any:
        import torch  # noqa: PLC0415

        name = node.get("dtype")
        dtype = _dtypes().get(name) if isinstance(name, str) else None
        shape = node.get("shape")
        if dtype is None:
            raise StateError(f"{STRUCTURE}: {name!r} is not a torch dtype a tensor can be "
                             "rebuilt with")
        if (not isinstance(shape, list) or len(shape) > 64
                or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < 2**62
                           for n in shape)
                or math.prod(n for n in shape if n) >= 2**62):
            raise StateError(f"{STRUCTURE}: shape {str(shape)[:80]} is not a list of sizes")
        data = self.take(node.get("tensor"), "a tensor")
        if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 1:
            raise StateError(f"{STRUCTURE}: shard of a tensor is not a flat byte array")
        count = math.prod(shape)
        size = torch.empty((), dtype=dtype).element_size()
        if data.nbytes != count * size:
            raise StateError(f"{STRUCTURE}: {data.nbytes} bytes for a {dtype} tensor of shape "
                             f"{tuple(shape)}")
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        if not data.flags.writeable:
            data = data.copy()  # torch wants writable memory; a restore's own arrays are
        flat = torch.from_numpy(data)
        return (flat if dtype == torch.uint8 else flat.view(dtype)).reshape(shape)

    def build(self, node: Any, depth: int) -> Any:  # noqa: PLR0911 - one per kind
        if depth > MAX_DEPTH or not isinstance(node, dict) or len(node) < 1:
            raise StateError(f"{STRUCTURE}: a node is not an object, or nested too deep")
        if "tensor" in node:
            return self.tensor(node)
        if len(node) != 1:
            raise StateError(f"{STRUCTURE}: a node has keys {sorted(node)}")
        (kind, body), = node.items()
        if kind == "v" and (body is None or isinstance(body, bool)):
            return body
        if kind == "int" and isinstance(body, str) and len(body.lstrip("-")) <= INT_DIGITS:
            try:
                return int(body)
            except ValueError:
                pass
        elif kind == "hexint" and isinstance(body, str) and body.lstrip("-").startswith("0x"):
            try:
                return int(body, 16)
            except ValueError:
                pass
        elif kind == "fbits" and isinstance(body, str) and _HEX16.fullmatch(body):
            return float(struct.unpack("<d", bytes.fromhex(body))[0])
        elif kind == "float" and isinstance(body, str) and len(body) <= 40:
            try:
                return float.fromhex(body)
            except (ValueError, OverflowError):
                pass
        elif kind == "str" and isinstance(body, str):
            return body
        elif kind == "bytes":
            data = self.take(body, "bytes")
            return bytes(data) if not isinstance(data, bytes) else data
        elif kind in ("ndarray", "npscalar"):
            data = self.take(body, "an array")
            if isinstance(data, np.ndarray):
                return data if kind == "ndarray" else data[()]
        elif kind == "dict" and isinstance(body, list):
            out: dict[str | int, Any] = {}
            for item in body:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], list)
                        and len(item[0]) == 2 and item[0][0] in ("s", "i")
                        and isinstance(item[0][1], str)):
                    raise StateError(f"{STRUCTURE}: a dict item is not [[kind, key], node]")
                key: str | int = item[0][1]
                if item[0][0] == "i":
                    try:
                        key = int(item[0][1])
                    except ValueError:
                        raise StateError(f"{STRUCTURE}: int key {item[0][1]!r}") from None
                if key in out:
                    raise StateError(f"{STRUCTURE}: key {key!r} twice")
                out[key] = self.build(item[1], depth + 1)
            return out
        elif kind in ("list", "tuple") and isinstance(body, list):
            items = [self.build(v, depth + 1) for v in body]
            return items if kind == "list" else tuple(items)
        raise StateError(f"{STRUCTURE}: a {kind!r} node is malformed")


def is_nested(state: Mapping[str, Any]) -> bool:
    return STRUCTURE in state


def unflatten(state: Mapping[str, Any]) -> dict[str, Any]:
    """The state `flatten` was given, from the decoded shards of a verified step."""
    raw = state[STRUCTURE]
    # flatten writes at most this: anything larger is not its tree, and parsing it could
    # take gigabytes first.
    if not isinstance(raw, bytes) or len(raw) > MAX_STRUCTURE:
        raise StateError(f"{STRUCTURE}: not a bytes shard of at most {MAX_STRUCTURE} bytes")
    try:
        # A level of the tree is at most 4 of JSON's (a dict item: [[kind, key], node]); a
        # state's strings are Python's, surrogates and all, and come back as they went.
        doc = safejson.loads(raw, max_bytes=MAX_STRUCTURE, max_depth=4 * MAX_DEPTH + 8,
                             lone_surrogates=True)
    except safejson.JsonError as exc:
        raise StateError(f"{STRUCTURE}: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise StateError(f"{STRUCTURE}: format is not {FORMAT}")
    b = _Builder(state)
    try:
        out = b.build(doc.get("tree"), 0)
    except (TypeError, ValueError, OverflowError, RuntimeError, MemoryError) as exc:
        # torch and numpy's own refusals of what a damaged tree asks for: a bad copy, which
        # restore walks past, never a crash of the restoring rank.
        raise StateError(f"{STRUCTURE}: cannot be rebuilt: {type(exc).__name__}: "
                         f"{str(exc)[:200]}") from None
    if not isinstance(out, dict):
        raise StateError(f"{STRUCTURE}: the top of the tree is not a dict")
    unused = set(state) - b.used - {STRUCTURE}
    if unused:
        raise StateError(f"{STRUCTURE}: shards {sorted(unused)[:5]} belong to no node")
    return out
