"""The offloading connector's storage below the device pool: a CPU tier, then a disk tier.

A *payload* is one KV block, every layer: ``{"k": [L, block_size, Hkv, D], "v": ...}`` (and
``"k_scale"``, ``"v_scale"`` ``[L, block_size, Hkv]`` for an INT8 / FP8 cache), keyed by the
block's prefix-cache hash (:mod:`labkit.kv.prefix`: chained, salt included), so a hit here
means exactly what a device prefix hit means.

- :class:`CPUTier`: payloads in host memory, least recently used first out, capped in bytes.
  What it evicts is handed back to the caller, which spills it to the next tier.
- :class:`DiskTier`: one safetensors file per block in a directory of its own, capped in
  bytes (file sizes). Each file's metadata carries its key and a sha256 of its tensors; a file
  that does not parse, is truncated, has another key, shape or dtype, or fails the checksum is
  deleted and reported as a miss (``counters["corrupt"]``), so it is recomputed, never used.
- :class:`TieredStore`: CPU, then disk; a block evicted from CPU goes to disk, one evicted from
  disk is gone.

Why the directory is private (a fresh ``mkdtemp`` under the one configured, removed at
``close()``): the keys are token hashes, not model identities. Files left by another model, or
another engine sharing the directory, would have valid checksums and the right keys but
another model's KV. Reusing files across processes would need the model in the key (LMCache
keys carry the model name); this tier is a cache for one engine's lifetime.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import weakref
from collections import OrderedDict
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from labkit.kv.prefix import BlockHash

Payload = dict[str, torch.Tensor]
Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]  # name -> (shape, dtype) of one block

FORMAT = "labkit-kv-block-1"


def payload_nbytes(payload: Payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload.values())


def payload_checksum(payload: Payload) -> str:
    """sha256 over every tensor's name, dtype, shape and raw bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(payload):
        t = payload[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _new_counters() -> dict[str, int]:
    return {"hits": 0, "loads": 0, "bytes_loaded": 0, "stores": 0, "bytes_stored": 0,
            "evictions": 0}


class CPUTier:
    """Payloads in host memory, an LRU capped at ``capacity_bytes``."""

    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.blocks: OrderedDict[BlockHash, Payload] = OrderedDict()  # first = least recent
        self.bytes_used = 0
        self.counters = _new_counters()

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.blocks

    def get(self, key: BlockHash) -> Payload | None:
        p = self.blocks.get(key)
        if p is not None:
            self.blocks.move_to_end(key)
        return p

    def put(self, key: BlockHash, payload: Payload) -> list[tuple[BlockHash, Payload]]:
        """Store (or refresh) a block; returns what had to leave to make room, oldest first. A
        block larger than the whole tier is returned itself, unstored."""
        n = payload_nbytes(payload)
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return []
        if n > self.capacity_bytes:
            return [(key, payload)]
        out = []
        while self.bytes_used + n > self.capacity_bytes:
            k, p = self.blocks.popitem(last=False)
            self.bytes_used -= payload_nbytes(p)
            self.counters["evictions"] += 1
            out.append((k, p))
        self.blocks[key] = payload
        self.bytes_used += n
        self.counters["stores"] += 1
        self.counters["bytes_stored"] += n
        return out


class DiskTier:
    """One safetensors file per block, an LRU capped at ``capacity_bytes`` of file sizes."""

    name = "disk"

    def __init__(self, directory: str | os.PathLike, capacity_bytes: int, layout: Layout) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self.dir = Path(tempfile.mkdtemp(prefix="labkit-kv-", dir=directory))
        self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.capacity_bytes = capacity_bytes
        self.layout = layout
        self.files: OrderedDict[BlockHash, int] = OrderedDict()  # key -> file size
        self.bytes_used = 0
        self.counters = {**_new_counters(), "corrupt": 0}

    def path(self, key: BlockHash) -> Path:
        return self.dir / f"{key.hex()}.safetensors"

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.files

    def put(self, key: BlockHash, payload: Payload) -> None:
        """Write a block's file (atomically: a reader never sees half a file); evict the least
        recently used files until it fits. A block larger than the tier is dropped."""
        if key in self.files:
            self.files.move_to_end(key)
            return
        meta = {"format": FORMAT, "key": key.hex(), "sha256": payload_checksum(payload)}
        data = st_save({k: v.contiguous() for k, v in payload.items()}, metadata=meta)
        if len(data) > self.capacity_bytes:
            return
        while self.bytes_used + len(data) > self.capacity_bytes:
            self._drop(next(iter(self.files)))
            self.counters["evictions"] += 1
        tmp = self.dir / f".{key.hex()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, self.path(key))
        self.files[key] = len(data)
        self.bytes_used += len(data)
        self.counters["stores"] += 1
        self.counters["bytes_stored"] += len(data)

    def get(self, key: BlockHash) -> Payload | None:
        """The block's payload, verified; None (and the file deleted) if it is missing or bad."""
        if key not in self.files:
            return None
        payload = self._read_verified(key)
        if payload is None:
            self.counters["corrupt"] += 1
            self._drop(key)
            return None
        self.files.move_to_end(key)
        return payload

    def _read_verified(self, key: BlockHash) -> Payload | None:
        try:
            data = self.path(key).read_bytes()
            n = int.from_bytes(data[:8], "little")
            meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
            payload = st_load(data)
        except Exception:  # noqa: BLE001 - any parse failure of the file means "corrupt"
            return None
        if meta.get("format") != FORMAT or meta.get("key") != key.hex():
            return None
        if set(payload) != set(self.layout) or any(
                tuple(payload[k].shape) != shp or payload[k].dtype != dt
                for k, (shp, dt) in self.layout.items()):
            return None
        return payload if payload_checksum(payload) == meta.get("sha256") else None

    def _drop(self, key: BlockHash) -> None:
        self.bytes_used -= self.files.pop(key)
        self.path(key).unlink(missing_ok=True)

    def clear(self) -> None:
        """Delete every file (the directory stays)."""
        for key in list(self.files):
            self._drop(key)

    def close(self) -> None:
        """Delete the directory and every file in it."""
        self._cleanup()
        self.files.clear()
        self.bytes_used = 0


class TieredStore:
    """CPU first, then disk (either may be absent: capacity 0 / no directory)."""

    def __init__(self, cpu_bytes: int, layout: Layout, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 0) -> None:
        self.cpu = CPUTier(cpu_bytes)
        self.disk = DiskTier(disk_dir, disk_bytes, layout) if disk_dir is not None else None

    def __contains__(self, key: BlockHash) -> bool:
        return key in self.cpu or (self.disk is not None and key in self.disk)

    def put(self, key: BlockHash, payload: Payload) -> None:
        """Store in CPU; what CPU evicts (or cannot hold) spills to disk, if there is one."""
        for k, p in self.cpu.put(key, payload):
            if self.disk is not None:
                self.disk.put(k, p)

    def get(self, key: BlockHash) -> tuple[str, Payload] | None:
        """(tier name, payload) from the first tier holding ``key``, or None."""
        p = self.cpu.get(key)
        if p is not None:
            return "cpu", p
        if self.disk is not None:
            p = self.disk.get(key)
            if p is not None:
                return "disk", p
        return None

    def tiers(self) -> list[CPUTier | DiskTier]:
        return [self.cpu] + ([self.disk] if self.disk is not None else [])

    def clear(self) -> None:
        """Forget every block, in both tiers."""
        self.cpu.blocks.clear()
        self.cpu.bytes_used = 0
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
