"""Issue 33 part 3: every reader of JSON a user controls gives its own verdict on anything.

Manifests (root's `ckpt verify`, `ls`, `gc`, the prolog's stage-in, S3, peers), restore
records (root's `report`), coordination files, peer messages, heartbeats, dtypes and nested
trees are each fed arbitrary hostile JSON: integers past Python's 4,300-digit limit, integers
that parse but overflow where they are used (sizes, offsets, steps), nesting deep enough for a
RecursionError, NaN and Infinity, keys given twice, bytes that are not UTF-8, lone surrogates,
wrong types. Each must come back as that reader's own error, one short line naming what is
wrong, or as a value it accepted; never as any other exception (a traceback that stops root's
command half way).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwarden.ckpt import beat, codec, dtypes, nested, restorelog
from gpuwarden.ckpt.coord import CoordError, FileCoordinator, agree
from gpuwarden.ckpt.fstier import FsTier
from gpuwarden.ckpt.manifest import LEGACY, Manifest, ManifestError, Shard, from_json, seal
from gpuwarden.ckpt.names import step_dir
from gpuwarden.ckpt.s3tier import MAC, S3Settings, S3Tier, manifest_mac
from gpuwarden.ckpt.tier import MANIFEST, CorruptStep
from gpuwarden.core.safejson import JsonError, loads
from gpuwarden.launch.heartbeat import BeatTable
from tests.unit.test_ckpt_s3tier import FakeS3

JOB = "job-33"
DIGITS = 5000  # past Python's 4,300-digit limit: a plain ValueError from json.loads


# ---- hostile documents -----------------------------------------------------------------------
class Raw(str):
    """JSON text put in as it is (what json.dumps cannot write: 5,000 digits, NaN, \\ud800)."""


class Pairs(list[tuple[str, Any]]):
    """An object as (key, value) pairs, a key possibly given twice."""


def render(v: Any) -> str:
    if isinstance(v, Raw):
        return str(v)
    if isinstance(v, Pairs):
        return "{" + ",".join(f"{json.dumps(k)}:{render(x)}" for k, x in v) + "}"
    if isinstance(v, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{render(x)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(render(x) for x in v) + "]"
    return json.dumps(v)


def plain(v: Any) -> bool:
    """Whether ``v`` is an ordinary Python value (a user can recompute a digest over it)."""
    if isinstance(v, (Raw, Pairs)):
        return False
    if isinstance(v, dict):
        return all(plain(x) for x in v.values())
    if isinstance(v, list):
        return all(plain(x) for x in v)
    return True


HUGE_INTS = st.integers(4301, 6000).map(lambda n: Raw("9" * n)) | st.integers(4301, 6000).map(
    lambda n: Raw("-" + "1" * n))
# Parse, but overflow a C long, a size, an offset, a step, the digits str() may print.
BIG_INTS = st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64, -(2**63), 10**12,
                            10**18, 10**19, -1]) | st.integers(2**63, 10**4200) | st.integers(
    -(10**4200), -(2**63))
NOT_FINITE = st.sampled_from([Raw("NaN"), Raw("Infinity"), Raw("-Infinity"), Raw("1e999"),
                              Raw("-1e400"), 1e308, -1e308, 5e-324])
SURROGATES = st.sampled_from([Raw('"\\ud800"'), Raw('"x\\udfff"'), Raw('"\\udc00\\ud800"'),
                              Raw('{"\\ud800":1}'), Raw('"\ud800"')])
DEEP = st.integers(33, 3000).map(lambda n: Raw("[" * n + "]" * n)) | st.integers(33, 3000).map(
    lambda n: Raw('{"a":' * n + "0" + "}" * n))
LEAVES = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False,
                                                                  allow_infinity=False)
          | st.text(max_size=20) | st.sampled_from(["", "<f4", "bytes", "ndarray", JOB, "x" * 300]))
HOSTILE = HUGE_INTS | BIG_INTS | NOT_FINITE | SURROGATES | DEEP
VALUES = st.recursive(
    LEAVES | HOSTILE,
    lambda c: (st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4)
               | st.tuples(st.text(max_size=8), c, c).map(
                   lambda t: Pairs([(t[0], t[1]), (t[0], t[2])]))),
    max_leaves=8)


def paths(doc: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every place in ``doc`` a value sits (a key of an object, an index of a list)."""
    yield at
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from paths(v, (*at, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from paths(v, (*at, i))


def put(doc: Any, at: tuple[Any, ...], value: Any) -> Any:
    if not at:
        return value
    out: Any = dict(doc) if isinstance(doc, dict) else list(doc)
    out[at[0]] = put(out[at[0]], at[1:], value)
    return out


@st.composite
def documents(draw: st.DrawFn, base: dict[str, Any] | None,
              sealed: bool = False) -> bytes:
    """Bytes a user could leave where ``base`` (a valid document) belongs: ``base`` with one
    place made hostile (the digest then recomputed, as a user can), a key given twice, or
    anything at all; some of them then not UTF-8."""
    how = draw(st.sampled_from(["one field", "one field", "a key twice", "anything"])
               if base is not None else st.just("anything"))
    if how == "anything" or base is None:
        doc: Any = draw(VALUES)
    elif how == "a key twice":
        key = draw(st.sampled_from(sorted(base)))
        doc = Pairs([*base.items(), (key, draw(LEAVES | HOSTILE | st.just(base[key])))])
    else:
        at = draw(st.sampled_from([p for p in paths(base) if p]))
        doc = put(base, at, draw(HOSTILE | VALUES))
        if sealed and isinstance(doc, dict) and plain(doc) and at != ("digest",):
            doc = seal(doc)
    text = render(doc)
    raw = text.encode("utf-8", "surrogatepass")  # a raw lone surrogate stays one
    damage = draw(st.sampled_from(["none", "none", "none", "bad byte", "utf-16", "cut"]))
    if damage == "bad byte":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc0\x80", b"\xed\xa0\x80"])) + raw[at:]
    elif damage == "utf-16":
        raw = text.encode("utf-16", "surrogatepass")
    elif damage == "cut":
        raw = raw[:draw(st.integers(0, len(raw)))]
    return raw


# ---- the readers --------------------------------------------------------------------------
def a_manifest(step: int = 3, version: int = 2) -> Manifest:
    state = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "tag": b"abc",
             "rec": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8", (2,))])}
    shards, _ = codec.encode(state)
    return Manifest(JOB, step, 1, 0, tuple(shards), 1.7e9, {"k": "v"}, version=version)


@dataclass(frozen=True)
class Reader:
    name: str
    read: Callable[[bytes], object]  # raises ``verdict`` when it refuses
    verdict: type[Exception] | tuple[type[Exception], ...]
    base: dict[str, Any] | None = None  # a document it accepts
    sealed: bool = False  # base carries a digest a user can recompute
    surrogates: bool = False  # takes lone surrogates: Python's own strings, as they were saved


def _fs_tier() -> Callable[[bytes], object]:
    root = tempfile.mkdtemp(prefix="gw-hostile-")
    tier = FsTier("shared", root, JOB)
    m = a_manifest()
    tier.commit(m, codec.encode({"w": np.arange(6, dtype=np.float32).reshape(2, 3),
                                 "tag": b"abc",
                                 "rec": np.zeros(2, dtype=[("a", "<i4"), ("b", "<f8", (2,))])})[1])
    path = Path(tier.dir) / step_dir(3) / MANIFEST

    def read(raw: bytes) -> object:
        path.write_bytes(raw)
        return tier.verify(3)  # root's `ckpt verify`
    return read


def _s3_tier() -> Callable[[bytes], object]:
    key = b"k" * 32
    fake = FakeS3()
    tier = S3Tier("s3", S3Settings("bucket"), JOB, 0, s3=fake, key=key)

    def read(raw: bytes) -> object:
        fake.objects[tier._key(3, MANIFEST)] = raw
        fake.objects[tier._key(3, MAC)] = manifest_mac(key, raw).encode()
        return tier.manifest(3)
    return read


def _coordination() -> Callable[[bytes], object]:
    d = tempfile.mkdtemp(prefix="gw-hostile-coord-")

    def read(raw: bytes) -> object:
        shutil.rmtree(os.path.join(d, "coord"), ignore_errors=True)
        me = FileCoordinator(d, 0, 2, sleep=lambda s: None)
        for name in ("agree-r0-s0.rank-1", "first-step", "durable-shared.rank-1"):
            (Path(d) / "coord" / name).write_bytes(raw)
        me.publish_durable("shared", 5)
        floor = me.durable_floor("shared")  # None, or a step: never an exception
        assert floor is None or isinstance(floor, int)
        try:
            assert isinstance(me.propose("first-step", 7), int)
        except CoordError as exc:
            _clear(exc)
        return agree(me, "agree-r0-s0", [1, 2], timeout=0)
    return read


TOKEN = b"t" * 32


def _beat(raw: bytes) -> object:
    data = beat.MAGIC + hmac.new(TOKEN, b"gpuwarden-beat\0" + raw, hashlib.sha256).digest() + raw
    table = BeatTable(JOB, TOKEN)
    table.begin(1, 4)
    why = table.offer(data, "10.0.0.9")  # the launcher's receiver thread: never raises
    assert why is None or isinstance(why, str)
    return beat.decode(TOKEN, data)


def _peer_message(raw: bytes) -> object:
    from gpuwarden.ckpt import peerwire

    return peerwire.decode_message(raw, "request")


def _nested(raw: bytes) -> object:
    return nested.unflatten({nested.STRUCTURE: raw})


_BEAT = {"job": JOB, "gen": 1, "rank": 0, "host": "n1", "step_id": "0", "seq": 1,
         "progress": 10, "done": False, "sent": 1.7e9}
_RECORD = restorelog.RestoreRecord(JOB, 0, "r1-s0", 10, "shared", 1 << 30, 2.0, 1.7e9,
                                   1.6e9).doc()
_TREE = json.loads(nested.flatten({"a": {"b": [1, 2.5, "x"], 3: None, "big": 2**70}})[
    nested.STRUCTURE])
_DTYPE = json.loads(dtypes.describe(np.dtype([("a", "<i4"), ("b", "<f8", (2,))])))

READERS = [
    Reader("manifest", lambda raw: from_json(raw, "MANIFEST.json"), ManifestError,
           json.loads(a_manifest().to_json()), sealed=True),
    Reader("legacy manifest", lambda raw: from_json(raw, "MANIFEST.json"), ManifestError,
           json.loads(a_manifest(version=LEGACY).to_json())),
    Reader("fs tier verify", _fs_tier(), CorruptStep, json.loads(a_manifest().to_json()),
           sealed=True),
    Reader("s3 tier manifest", _s3_tier(), CorruptStep, json.loads(a_manifest().to_json()),
           sealed=True),
    Reader("restore record", lambda raw: restorelog.parse(raw, JOB, "restore-r1-s0.rank-0"),
           restorelog.BadRecord, _RECORD),
    Reader("coordination file", _coordination(), CoordError, {"steps": [1, 2]}),
    Reader("heartbeat", _beat, beat.BadBeat, _BEAT),
    Reader("peer message", _peer_message, __import__("gpuwarden.ckpt.peerwire").ckpt.peerwire
           .PeerError, {"op": "get", "rank": 0, "step": 3}),
    Reader("dtype", lambda raw: dtypes.parse(raw.decode("utf-8", "surrogateescape")),
           dtypes.DtypeError, _DTYPE),
    Reader("nested tree", _nested, codec.StateError, _TREE, surrogates=True),
]


def _clear(exc: Exception) -> None:
    msg = str(exc)
    assert msg.strip(), f"{type(exc).__name__} without a message"
    assert len(msg) < 1000 and "\n" not in msg, f"not one short line: {msg[:300]!r}..."


@pytest.mark.parametrize("reader", READERS, ids=[r.name for r in READERS])
@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_reader_gives_its_own_verdict_on_any_hostile_json(reader: Reader,
                                                                data: st.DataObject) -> None:
    raw = data.draw(documents(reader.base, reader.sealed), label="document")
    try:
        reader.read(raw)
    except reader.verdict as exc:
        _clear(exc)


@pytest.mark.parametrize("reader", READERS, ids=[r.name for r in READERS])
@pytest.mark.parametrize("hazard", [
    Raw("1" * DIGITS), Raw("-" + "9" * DIGITS), 2**64, Raw("NaN"), Raw("1e999"),
    Raw("[" * 5000 + "]" * 5000), Raw('"\\ud800"')], ids=[
    "5000 digits", "-5000 digits", "2**64", "NaN", "1e999", "5000 deep", "lone surrogate"])
def test_each_hazard_in_each_field_is_a_verdict(reader: Reader, hazard: Any) -> None:
    """The hazards one by one, in every field of a valid document (the property test draws
    them at random)."""
    assert reader.base is not None
    if reader.surrogates and hazard == Raw('"\\ud800"'):
        pytest.skip("its strings are a state's own: test_a_state_string_with_a_surrogate_...")
    for at in (p for p in paths(reader.base) if p):
        doc = put(reader.base, at, hazard)
        if reader.sealed and plain(doc) and at != ("digest",):
            doc = seal(doc)
        try:
            reader.read(render(doc).encode("utf-8", "surrogatepass"))
        except reader.verdict as exc:
            _clear(exc)
        else:
            pytest.fail(f"{reader.name}: {hazard!s:.20} at {at} was accepted")


@pytest.mark.parametrize("reader", READERS, ids=[r.name for r in READERS])
def test_the_valid_document_is_still_accepted(reader: Reader) -> None:
    assert reader.base is not None
    doc = seal(reader.base) if reader.sealed else reader.base
    if reader.name == "coordination file":
        doc = [1, 2]  # agree's round: a rank's steps
    reader.read(render(doc).encode())


@pytest.mark.parametrize("reader", READERS, ids=[r.name for r in READERS])
def test_a_key_given_twice_is_refused(reader: Reader) -> None:
    """Two readers of one document must never see two documents (json keeps the last)."""
    if reader.name == "coordination file":
        pytest.skip("agree's values are lists, not objects")
    assert reader.base is not None
    key = sorted(reader.base)[0]
    raw = render(Pairs([*reader.base.items(), (key, reader.base[key])])).encode()
    with pytest.raises(reader.verdict, match="given twice"):
        reader.read(raw)


def test_a_state_string_with_a_surrogate_comes_back_as_it_was_saved() -> None:
    """A file name decoded with surrogateescape, in a job's state: saved, so restored."""
    state = {"files": [os.fsdecode(b"shard-\xff.bin")], "\udcff": 1}
    assert nested.unflatten(nested.flatten(state)) == state


@pytest.mark.parametrize("metadata", [{"file": os.fsdecode(b"\xff.bin")}, {"n": 1}])
def test_save_refuses_metadata_a_restore_could_not_read_back(tmp_path: Path,
                                                             metadata: Any) -> None:
    from gpuwarden.ckpt.checkpointer import Checkpointer

    tier0 = FsTier("memory", str(tmp_path / "shm"), JOB)
    ck = Checkpointer(JOB, tier0, [], sleep=lambda s: None)
    try:
        with pytest.raises(codec.StateError, match="metadata"):
            ck.save(1, {"w": b"x"}, metadata=metadata)
        assert tier0.steps() == []
        ck.save(2, {"w": b"x"}, metadata={"file": "ok.bin"})
        assert tier0.manifest(2).metadata == {"file": "ok.bin"}
    finally:
        ck.close(timeout=5)


# ---- the shared decoder itself --------------------------------------------------------------
@pytest.mark.parametrize(("text", "why"), [
    ("[" + "1" * DIGITS + "]", "5000 digits"),
    (f"[{2**63}]", "out of range"),
    ("[" * 100_000, "nested more than"),
    ("[" * 33 + "]" * 33, "nested more than 32"),
    ('{"a":1,"a":2}', "'a' is given twice"),
    ("[NaN]", "NaN is not a JSON number"),
    ("[-Infinity]", "Infinity is not a JSON number"),
    ("[1e999]", "not finite"),
    (b"[\xff]", "not UTF-8"),
    (b'["\xed\xa0\x80"]', "not UTF-8"),
    (b'\xff\xfe[\x00]\x00', "not UTF-8"),  # UTF-16: json.loads would guess it
    ('["\\ud800"]', "lone surrogate"),
    ('{"\\udc00":1}', "lone surrogate"),
    ("[\"\ud800\"]", "lone surrogate"),
    ("{", "not JSON: Expecting"),
    ("x" * 2_000_000, "more than"),
])
def test_the_decoder_refuses_each_hazard_naming_it(text: str | bytes, why: str) -> None:
    with pytest.raises(JsonError, match=why) as info:
        loads(text)
    _clear(info.value)


def test_the_decoder_takes_ordinary_json_within_bounds() -> None:
    assert loads(b'{"a":[1,-2,2.5,"\\ud83d\\ude00",true,null]}') == {
        "a": [1, -2, 2.5, "\U0001f600", True, None]}
    assert loads(f"[{2**63 - 1},{-(2**63 - 1)}]") == [2**63 - 1, -(2**63 - 1)]
    assert loads("[" * 32 + "]" * 32, max_depth=32) is not None
    assert loads("[1e308]") == [1e308]


# ---- root's `ckpt verify` over a job with one corrupt step ------------------------------------
def _cli(tmp_path: Path) -> Callable[..., tuple[int, str, BaseException | None]]:
    from click.testing import CliRunner

    from gpuwarden.cli import cli
    from gpuwarden.config import Config
    from gpuwarden.config.ckpt import CkptConfig
    from gpuwarden.config.context import Context

    ctx = Context()
    ctx._config = replace(Config(), ckpt=CkptConfig(memory_root=str(tmp_path / "shm"),
                                                    shared_root=str(tmp_path / "fsx")))

    def run(*args: str) -> tuple[int, str, BaseException | None]:
        res = CliRunner().invoke(cli, list(args), obj=ctx)
        return res.exit_code, res.output, res.exception
    return run


def _save(tier: FsTier, step: int) -> None:
    shards, data = codec.encode({"w": np.full((4, 4), step, dtype=np.float32)})
    tier.commit(Manifest(JOB, step, 1, 0, tuple(shards), time.time(), {}), data)


@pytest.mark.parametrize("field", ["created_at", "step", "shards.size"])
def test_root_verify_reports_a_5000_digit_manifest_corrupt_and_verifies_the_others(
        tmp_path: Path, field: str) -> None:
    shm = FsTier("memory", str(tmp_path / "shm"), JOB)
    fsx = FsTier("shared", str(tmp_path / "fsx"), JOB)
    for step in (1, 2, 3):
        _save(shm, step)
        _save(fsx, step)
    path = Path(shm.dir) / step_dir(2) / MANIFEST
    doc = json.loads(path.read_text())
    at = ("shards", 0, "size") if field == "shards.size" else (field,)
    path.write_text(render(put(doc, at, Raw("1" * DIGITS))))
    code, out, exc = _cli(tmp_path)("ckpt", "verify", JOB)
    assert isinstance(exc, SystemExit), f"a traceback, not a verdict: {exc!r}\n{out}"
    lines = [" ".join(line.split()) for line in out.splitlines()]
    corrupt = [line for line in lines if line.startswith("memory step 2: CORRUPT:")]
    assert len(corrupt) == 1 and f"({DIGITS} digits) is out of range" in corrupt[0], out
    assert str(path) in corrupt[0]
    for tier in ("memory", "shared"):
        for step in (1, 3):
            assert any(line.startswith(f"{tier} step {step}: ok") for line in lines), out
    assert any(line.startswith("shared step 2: ok") for line in lines), out
    assert code == 1  # docs/checkpointing.md: exit 1 when any copy is corrupt


def test_root_verify_names_a_manifest_whose_sizes_parse_but_overflow(tmp_path: Path) -> None:
    """A size of 2**64, digest recomputed (as a user can): corrupt, the rest still verified."""
    shm = FsTier("memory", str(tmp_path / "shm"), JOB)
    for step in (1, 2):
        _save(shm, step)
    path = Path(shm.dir) / step_dir(1) / MANIFEST
    doc = json.loads(path.read_text())
    path.write_text(json.dumps(seal(put(doc, ("shards", 0, "size"), 2**64))))
    code, out, exc = _cli(tmp_path)("ckpt", "verify", JOB)
    assert isinstance(exc, SystemExit) and code == 1, out
    assert "memory   step 1: CORRUPT:" in out and "out of range" in out
    assert "memory   step 2: ok" in out


# ---- the other readers, one by one -----------------------------------------------------------
def test_a_shard_of_no_elements_but_huge_dimensions_is_a_state_error() -> None:
    shard = Shard("w", 0, codec.checksum(b""), "ndarray", "<f4", (0, 2**62, 2**62))
    with pytest.raises(codec.StateError, match="shape"):
        codec.decode(shard, b"")


def test_a_peer_answers_a_hostile_request_with_an_error_and_keeps_serving(
        tmp_path: Path) -> None:
    from gpuwarden.ckpt import peerwire
    from gpuwarden.ckpt.peer import Address, PeerServer, PeerTier

    key = b"k" * 32
    srv = PeerServer(key, JOB, str(tmp_path / "node"), host="127.0.0.1", timeout=5)
    try:
        for header in (b"[" * 5000, b'{"op":"get","rank":' + b"1" * DIGITS + b',"step":1}',
                       b'{"op":"list","rank":0,"rank":1}', b'{"op":"list","rank":\xff}'):
            with socket.create_connection(("127.0.0.1", srv.port), timeout=5) as sock:
                hello = peerwire.recv_frame(sock, 64)
                nonce_s, nonce_c = hello[len(peerwire.MAGIC):], secrets.token_bytes(32)
                peerwire.send_frame(sock, nonce_c)
                peerwire.send_frame(sock, header)
                peerwire.send_frame(sock, peerwire.hmac_over(key, b"hdr", nonce_s, nonce_c,
                                                             header).digest())
                assert peerwire.recv_frame(sock, 64)  # the server's proof of the key
                resp = json.loads(peerwire.recv_frame(sock))
                assert resp["ok"] is False and "not JSON" in resp["error"], resp
        # Still serving the job's own ranks.
        assert PeerTier(key, JOB, 0, [], [Address("127.0.0.1", srv.port)]).steps() == []
    finally:
        srv.stop()


def test_stage_in_ignores_rank_directories_that_are_not_ranks(tmp_path: Path) -> None:
    """A user's shared job directory holding ``rank-<5,000 digits>`` or ``rank-`` in other
    scripts' digits: not ranks; the prolog's stage-in reads the real ones."""
    from gpuwarden.ckpt import stagein

    fsx = FsTier("shared", str(tmp_path / "fsx"), JOB)
    _save(fsx, 4)
    for odd in ("rank-" + "1" * DIGITS, "rank-\u0661\u0662\u0663\u0664\u0665"):
        try:
            (tmp_path / "fsx" / JOB / odd).mkdir(mode=0o700)
        except OSError as exc:  # a name longer than the filesystem takes
            assert len(odd) > 255, exc
    (tmp_path / "fsx" / JOB / ("rank-" + "1" * 200)).mkdir(mode=0o700)
    req = stagein.Request(JOB.removeprefix("job-"), os.geteuid(), os.getegid(), (), "n1",
                          ("n1",), str(tmp_path / "shm"), str(tmp_path / "fsx"), 30.0)
    assert stagein._discover(req) == (1, [0])


@pytest.mark.parametrize("var", ["SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS",
                                 "SLURM_RESTART_COUNT"])
def test_a_job_environment_in_other_digits_is_a_clear_error(var: str) -> None:
    from gpuwarden.ckpt.job import JobEnvError, job_env

    env = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1",
           "SLURM_RESTART_COUNT": "0", var: "\u0661"}  # ARABIC-INDIC DIGIT ONE: isdigit()
    with pytest.raises(JobEnvError, match=var):
        job_env(env)
