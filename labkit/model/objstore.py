"""Checkpoints from an S3-compatible object store: ``--model s3://bucket/prefix``.

A replica that scales up from zero spends its cold start fetching weights, and how it fetches
decides how long that is. An object store serves one connection at a bounded rate (tens to a
couple of hundred MB/s per stream on the public clouds), while the node's link carries many
times that; so the field's loaders split each object into byte ranges fetched on many
connections at once (vLLM's Run:ai model streamer, ``s5cmd``, ``aws s3 cp`` with multipart
download), stream tensors straight into the model as their bytes arrive instead of writing a
file and reading it back, and keep a node-local copy so the next start on the same node is a
disk read. This module has each of those as a mode, so ``labkit bench ops cold-start`` can put
them side by side:

* ``"sequential"``: one GET per object, read to the end (what a naive loader does);
* ``"ranged"``: each object as parallel ranged GETs of ``part_size`` bytes on
  ``max_connections`` connections, written into the node-local cache (the default);
* :func:`load_streaming`: ranged GETs of each *tensor's* bytes, copied into the model's
  parameters as they complete: nothing is written to disk;
* a cache hit: the node-local copy's manifest names the same objects (ETag and size), so
  nothing is fetched.

An object that is cut short (its safetensors header promises more bytes than the object has),
that changes between the listing and the read (the GET is conditional on the listed ETag), or
whose tensors do not fit the config is rejected with a :class:`CheckpointError` that says which.
The endpoint comes from ``endpoint_url`` or ``AWS_ENDPOINT_URL`` (boto3's own setting), the
credentials from boto3's usual chain; ``labkit bench ops cold-start`` runs a real S3 server
(moto's) on loopback behind a bandwidth throttle.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labkit.errors import CheckpointError

S3_SCHEME = "s3://"
MODES = ("sequential", "ranged")
_NEEDED = ("config.json",)
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def is_s3_uri(path_or_name: object) -> bool:
    return str(path_or_name).startswith(S3_SCHEME)


@dataclass
class S3Source:
    """Where a checkpoint lives and how to read it. ``part_size`` and ``max_connections`` shape
    the ranged GETs; ``cache_dir`` is the node-local copy (``$LABKIT_S3_CACHE`` or
    ``~/.cache/labkit/s3``)."""

    uri: str
    endpoint_url: str | None = None
    part_size: int = 8 << 20
    max_connections: int = 8
    cache_dir: Path | None = None

    def __post_init__(self) -> None:
        if not is_s3_uri(self.uri):
            raise CheckpointError(f"{self.uri!r} is not an s3:// URI")
        bucket, _, prefix = self.uri[len(S3_SCHEME):].partition("/")
        if not bucket:
            raise CheckpointError(f"{self.uri!r} names no bucket (s3://bucket/prefix)")
        self.bucket, self.prefix = bucket, prefix.strip("/")
        if self.part_size < 1 or self.max_connections < 1:
            raise ValueError("part_size and max_connections must be positive")
        root = self.cache_dir or Path(os.environ.get(
            "LABKIT_S3_CACHE", Path.home() / ".cache" / "labkit" / "s3"))
        self.local_dir = Path(root) / self.bucket / (self.prefix or "_root")

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def client(self) -> Any:
        try:
            import boto3
            from botocore.config import Config
        except ImportError as e:
            raise CheckpointError("s3:// checkpoints need boto3: pip install "
                                  "'labkit[objstore]'") from e
        # one pooled connection per parallel GET, and no retries hiding a broken object
        cfg = Config(max_pool_connections=self.max_connections + 2,
                     retries={"max_attempts": 1, "mode": "standard"})
        return boto3.client("s3", endpoint_url=self.endpoint_url
                            or os.environ.get("AWS_ENDPOINT_URL"), config=cfg)


def list_checkpoint(src: S3Source, client: Any) -> dict[str, tuple[int, str]]:
    """name -> (size, ETag) of the checkpoint's objects; fails if config or weights are absent."""
    from botocore.exceptions import BotoCoreError, ClientError

    found: dict[str, tuple[int, str]] = {}
    start = src.key("")
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=src.bucket,
                                                                      Prefix=start):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(start):]
                if name and "/" not in name:
                    found[name] = (int(obj["Size"]), obj["ETag"])
    except (ClientError, BotoCoreError) as e:
        raise CheckpointError(f"cannot list {src.uri}: {e}") from e
    missing = [n for n in _NEEDED if n not in found]
    if missing or not any(w in found for w in _WEIGHTS):
        raise CheckpointError(f"{src.uri} is not a checkpoint: it has "
                              f"{sorted(found) or 'no objects'}; needs config.json and "
                              "model.safetensors (or its index)")
    return found


def get_range(src: S3Source, client: Any, name: str, etag: str, start: int, end: int) -> bytes:
    """Bytes [start, end) of one object, conditional on the ETag the listing gave."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        resp = client.get_object(Bucket=src.bucket, Key=src.key(name), IfMatch=etag,
                                 Range=f"bytes={start}-{end - 1}")
        data = resp["Body"].read()
    except ClientError as e:
        code = e.response.get("Error", {}).get("Code", "")
        if code in ("PreconditionFailed", "412"):
            raise CheckpointError(f"{src.uri}/{name} changed while it was being loaded "
                                  "(its ETag no longer matches the listing)") from e
        raise CheckpointError(f"cannot read {src.uri}/{name}: {e}") from e
    except BotoCoreError as e:
        raise CheckpointError(f"cannot read {src.uri}/{name}: {e}") from e
    if len(data) != end - start:
        raise CheckpointError(f"{src.uri}/{name}: asked for bytes {start}-{end - 1}, got "
                              f"{len(data)} bytes (the object is truncated)")
    return data


def _parts(size: int, part: int) -> list[tuple[int, int]]:
    return [(s, min(s + part, size)) for s in range(0, size, part)]


def download_objects(src: S3Source, client: Any, objects: dict[str, tuple[int, str]],
                     mode: str, pool: ThreadPoolExecutor) -> dict[str, bytearray]:
    """Every object's bytes: one GET each, one object after another (``sequential``), or all
    objects' ``part_size`` ranges at once on the pool's connections (``ranged``)."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    bufs = {name: bytearray(size) for name, (size, _) in objects.items()}

    def fill(job: tuple[str, int, int]) -> None:
        name, start, end = job
        bufs[name][start:end] = get_range(src, client, name, objects[name][1], start, end)

    if mode == "sequential":
        for name, (size, _) in sorted(objects.items()):
            if size:
                fill((name, 0, size))
    else:
        jobs = [(name, s, e) for name, (size, _) in sorted(objects.items())
                for s, e in _parts(size, src.part_size)]
        for _ in pool.map(fill, jobs):
            pass
    return bufs


def check_safetensors(name: str, data: bytes | bytearray) -> None:
    """A safetensors object must hold exactly the bytes its header promises: one cut short in
    the upload lists with its short size, so only the header can tell."""
    if len(data) < 8:
        raise CheckpointError(f"{name}: {len(data)} bytes, shorter than a safetensors header")
    (n,) = struct.unpack("<Q", bytes(data[:8]))
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{name}: the safetensors header is cut short or corrupt "
                              f"({e})") from e
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"),
              default=0)
    if 8 + n + end != len(data):
        raise CheckpointError(f"{name}: its header describes {8 + n + end} bytes but the "
                              f"object has {len(data)} (truncated or mismatched upload)")


def _manifest(listing: dict[str, tuple[int, str]]) -> dict[str, list]:
    return {k: [size, etag] for k, (size, etag) in sorted(listing.items())}


def cached(src: S3Source, listing: dict[str, tuple[int, str]]) -> bool:
    """Whether the node-local copy holds exactly the listed objects (same ETags and sizes)."""
    f = src.local_dir / ".labkit-manifest.json"
    try:
        return json.loads(f.read_text()) == _manifest(listing)
    except (OSError, json.JSONDecodeError):
        return False


def fetch_checkpoint(src: S3Source | str, mode: str = "ranged") -> Path:
    """The node-local folder holding ``src``'s checkpoint, downloading what the cache lacks.

    Files are written under temporary names and renamed, and the manifest is written last, so a
    start that dies mid-download leaves no copy a later start would trust."""
    src = src if isinstance(src, S3Source) else S3Source(src)
    client = src.client()
    listing = list_checkpoint(src, client)
    if cached(src, listing):
        return src.local_dir
    src.local_dir.mkdir(parents=True, exist_ok=True)
    (src.local_dir / ".labkit-manifest.json").unlink(missing_ok=True)
    with ThreadPoolExecutor(src.max_connections) as pool:
        bufs = download_objects(src, client, listing, mode, pool)
    for name, data in sorted(bufs.items()):
        if name.endswith(".safetensors"):
            check_safetensors(f"{src.uri}/{name}", data)
        tmp = src.local_dir / f".{name}.part"
        tmp.write_bytes(data)
        tmp.replace(src.local_dir / name)
    (src.local_dir / ".labkit-manifest.json").write_text(json.dumps(_manifest(listing)))
    return src.local_dir
