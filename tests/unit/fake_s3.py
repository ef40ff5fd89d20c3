"""One in-memory S3 bucket for the unit tests, with what the checkpoint code asks of boto3's
client: PUT, GET (whole or one ``Range: bytes=a-b``, answered as S3 answers it, 416 included),
DELETE, a paginated LIST (lazy, each page logged), and a log of the calls in order (the real SeaweedFS is in
tests/e2e/test_ckpt_core.py and test_ckpt_outages.py)."""

from __future__ import annotations

import io
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any

from botocore.exceptions import ClientError

_RANGE = re.compile(r"bytes=([0-9]+)-([0-9]+)")


def client_error(code: str, op: str, status: int = 400, message: str = "") -> ClientError:
    """A ClientError as botocore raises it, with the HTTP status in its metadata."""
    return ClientError({"Error": {"Code": code, "Message": message or code},
                        "ResponseMetadata": {"HTTPStatusCode": status}}, op)


class Body:
    """A GET's body as botocore 1.37 (Debian's, the test cluster's) gives it: read and close,
    no readinto (newer botocore has one; the code must not need it)."""

    def __init__(self, data: bytes) -> None:
        self._io = io.BytesIO(data)

    def read(self, amt: int | None = None) -> bytes:
        return self._io.read(amt)

    def close(self) -> None:
        self._io.close()


class FakeS3:
    def __init__(self, page_size: int = 1000) -> None:
        self.objects: dict[str, bytes] = {}
        self.page_size = page_size
        self.calls: list[tuple[str, str]] = []  # (operation, key or prefix), in call order
        # Called with (key, range or None) before each GET is answered: to delay or fail one.
        self.on_get: Callable[[str, tuple[int, int] | None], None] | None = None
        self._calls_lock = threading.Lock()

    def _log(self, op: str, key: str) -> None:
        with self._calls_lock:
            self.calls.append((op, key))

    def upload_fileobj(self, body: Any, bucket: str, key: str, Config: Any = None,
                       Callback: Any = None) -> None:
        data = body.read()
        self._log("put", key)
        self.objects[key] = data
        if Callback:
            Callback(len(data))

    def put_object(self, Bucket: str, Key: str, Body: bytes) -> None:
        self._log("put", Key)
        self.objects[Key] = bytes(Body)

    def delete_object(self, Bucket: str, Key: str) -> None:
        self._log("delete", Key)
        self.objects.pop(Key, None)

    def get_object(self, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        span = None
        if Range is not None:
            m = _RANGE.fullmatch(Range)
            assert m is not None, f"malformed Range {Range!r}"
            span = (int(m.group(1)), int(m.group(2)))
            assert span[0] <= span[1], f"malformed Range {Range!r}"
        self._log("get", Key)
        if self.on_get is not None:
            self.on_get(Key, span)
        if Key not in self.objects:  # as boto3 says it
            raise client_error("NoSuchKey", "GetObject", 404, Key)
        data = self.objects[Key]
        if span is None:
            return {"ContentLength": len(data), "Body": Body(data)}
        first, last = span
        if first >= len(data):
            raise client_error("InvalidRange", "GetObject", 416,
                               "The requested range is not satisfiable")
        last = min(last, len(data) - 1)
        return {"ContentLength": last - first + 1,
                "ContentRange": f"bytes {first}-{last}/{len(data)}",
                "Body": Body(data[first:last + 1])}

    def get_paginator(self, _op: str) -> Any:
        outer = self

        class Pages:
            def paginate(self, Bucket: str, Prefix: str,
                         Delimiter: str | None = None) -> Iterator[dict[str, Any]]:
                """Lazily, as boto3's page iterator: each page is asked for (and logged,
                ``list-page``) only when the caller gets to it. With ``Delimiter``, as S3: the
                keys with it after the prefix rolled up into one common prefix each (up to and
                with the delimiter), each taking one place on a page."""
                outer._log("list", Prefix)
                items: list[tuple[str, bool]] = []  # (key or common prefix, is a prefix)
                for k in sorted(outer.objects):
                    if not k.startswith(Prefix):
                        continue
                    cut = k.find(Delimiter, len(Prefix)) if Delimiter else -1
                    item = (k[:cut + len(Delimiter or "")], True) if cut >= 0 else (k, False)
                    if not items or items[-1] != item:
                        items.append(item)
                size = outer.page_size
                for i in range(0, max(len(items), 1), size):
                    outer._log("list-page", Prefix)
                    page = items[i:i + size]
                    out: dict[str, Any] = {}
                    if keys := [{"Key": k, "Size": len(outer.objects[k])}
                                for k, common in page if not common]:
                        out["Contents"] = keys
                    if common := [{"Prefix": k} for k, c in page if c]:
                        out["CommonPrefixes"] = common
                    yield out
        return Pages()

    def list_multipart_uploads(self, Bucket: str, Prefix: str) -> dict[str, Any]:
        return {"Uploads": []}
