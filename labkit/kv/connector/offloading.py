"""OffloadingConnector: a tiered prefix cache (device -> CPU -> disk), vLLM's offloading connector.

**What is saved, and when.** Every full block a request computes is copied to the CPU tier in
the step that computed it (layer by layer, ``save_kv_layer``, right after the layer wrote it),
unless the tiers already hold its key. The CPU tier's LRU spills to disk, the disk tier's LRU
deletes. This is vLLM's choice (it stores blocks as they fill), and the alternative, copying a
block out only when the device pool evicts it, was weighed and not taken: eviction happens while
the scheduler allocates, and the evicted block is written again in the same step (by a
copy-on-write, a swap-in or a load before the forward even runs), so the copy would have to run
ahead of every other block write of the step and the pool would have to report what it evicted.
Saving in the computing step needs neither: the block is still held by its request, nothing else
can write it, and a device eviction later costs nothing. The price is host traffic for blocks
that would never have been evicted (one copy per distinct key: the tiers are checked first).

**What is loaded.** At admission, after the device prefix cache matched its blocks, the
following full blocks of the prompt (never the last token) are looked up CPU, then disk, by the
same chained, salted keys the device prefix cache uses; the match stops at the first miss. A
disk block is read and verified (checksum, key, shape) *when it is matched*, so a corrupt file
ends the match there and its tokens are recomputed: the scheduler never counts a token the
worker could not load. The matched payloads are loaded into the fresh device blocks the
scheduler allocated, layer by layer before each layer attends; after the step those blocks are
published in the device prefix cache like computed ones.

All copies here are synchronous (the tests are deterministic on a CPU); on a GPU vLLM runs them
on a side stream and overlaps them with compute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from labkit.errors import EngineConfigError, KVConnectorError
from labkit.kv.connector.base import KVConnectorBase, KVConnectorMetadata
from labkit.kv.connector.tiers import Layout, Payload, TieredStore, payload_nbytes
from labkit.kv.prefix import BlockHash, hash_block_tokens
from labkit.utils import is_int


@dataclass
class OffloadingMetadata(KVConnectorMetadata):
    """One step's work: ``loads`` (device block, source tier, payload) and ``saves`` (device
    block, key), each in the order the scheduler decided them."""

    loads: list[tuple[int, str, Payload]] = field(default_factory=list)
    saves: list[tuple[int, BlockHash]] = field(default_factory=list)


class OffloadingConnector(KVConnectorBase):
    """``OffloadingConnector(cpu_bytes, disk_dir=None, disk_bytes=0)``: a CPU tier of
    ``cpu_bytes`` and, with ``disk_dir``, a disk tier of ``disk_bytes`` below it."""

    def __init__(self, cpu_bytes: int = 0, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 0) -> None:
        super().__init__()
        for name, v in (("cpu_bytes", cpu_bytes), ("disk_bytes", disk_bytes)):
            if not is_int(v) or v < 0:
                raise EngineConfigError(f"offloading connector: {name} must be an integer >= 0, "
                                        f"got {v!r}")
        if (disk_dir is None) != (disk_bytes == 0):
            raise EngineConfigError("offloading connector: disk_dir and disk_bytes > 0 go "
                                    f"together (got disk_dir={disk_dir!r}, disk_bytes="
                                    f"{disk_bytes})")
        if cpu_bytes == 0 and disk_dir is None:
            raise EngineConfigError("offloading connector with no tier: give cpu_bytes > 0 "
                                    "and/or disk_dir with disk_bytes")
        self.cpu_bytes, self.disk_dir, self.disk_bytes = cpu_bytes, disk_dir, disk_bytes
        self.store: TieredStore | None = None  # built by register_kv_caches (needs the shapes)
        self.block_size = 0
        self._caches: dict[str, list[torch.Tensor]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # per sequence: chained keys so far
        self._matched: dict[str, tuple[int, list[tuple[str, Payload]]]] = {}
        self._loads: list[tuple[int, str, Payload]] = []  # committed for the next meta
        self._staged: dict[str, torch.Tensor] = {}  # this step's loads, on the device
        self._saving: dict[str, torch.Tensor] = {}  # this step's saves, filled layer by layer
        self._src: torch.Tensor | None = None  # the device blocks this step saves
        self._saved_layers: set[int] = set()
        self.counters: dict[str, dict[str, int]] = {"device": {"hits": 0}}

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any]) -> OffloadingConnector:
        known = {"cpu_bytes", "disk_dir", "disk_bytes"}
        if set(extra) - known:
            raise EngineConfigError(f"unknown offloading connector settings "
                                    f"{sorted(set(extra) - known)}; valid: {sorted(known)}")
        return cls(**extra)

    # ---- worker side: registration ------------------------------------------------------------
    def register_kv_caches(self, kv_cache: Any) -> None:
        if self.store is not None:  # a second engine would read and write the first's blocks
            raise EngineConfigError("this OffloadingConnector already serves an engine; give "
                                    "each engine its own")
        names = (("k", kv_cache.k_caches), ("v", kv_cache.v_caches),
                 ("k_scale", kv_cache.k_scales), ("v_scale", kv_cache.v_scales))
        self._caches = {n: ts for n, ts in names if ts}
        self.block_size = kv_cache.block_size
        num_layers = len(kv_cache.k_caches)
        layout: Layout = {n: ((num_layers, *ts[0].shape[1:]), ts[0].dtype)
                          for n, ts in self._caches.items()}
        self.store = TieredStore(self.cpu_bytes, layout, self.disk_dir, self.disk_bytes)
        for tier in self.store.tiers():
            self.counters[tier.name] = tier.counters

    def _need_store(self) -> TieredStore:
        if self.store is None:
            raise KVConnectorError("the offloading connector has no KV cache: the engine calls "
                                   "register_kv_caches(kv_cache) before the first step")
        return self.store

    # ---- scheduler side -----------------------------------------------------------------------
    def block_hashes(self, seq: Any, n: int) -> list[BlockHash]:
        """The first ``n`` chained keys of ``seq``'s blocks (computed once, extended as it
        grows); equal to the device prefix cache's ``seq.block_hashes`` where both exist."""
        hs = self._hashes.setdefault(seq.seq_id, [])
        bs, toks = self.block_size, seq.token_ids
        while len(hs) < n:
            i = len(hs)
            hs.append(hash_block_tokens(hs[-1] if hs else None, toks[i * bs:(i + 1) * bs],
                                        seq.cache_salt))
        return hs[:n]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        store, bs = self._need_store(), self.block_size
        self._matched.pop(request.seq_id, None)
        if getattr(request, "skip_reading_prefix_cache", False) or num_computed_tokens % bs:
            return 0
        n_full = (len(request.token_ids) - 1) // bs
        found: list[tuple[str, Payload]] = []
        for key in self.block_hashes(request, n_full)[num_computed_tokens // bs:]:
            hit = store.get(key)  # a disk block is read and verified here
            if hit is None:
                break
            found.append(hit)
        self._matched[request.seq_id] = (num_computed_tokens, found)
        return len(found) * bs

    def update_state_after_alloc(self, request: Any, blocks: list[int],
                                 num_external_tokens: int) -> None:
        num_device, found = self._matched.pop(request.seq_id, (0, []))
        n = num_external_tokens // self.block_size
        if n > len(found) or len(blocks) != n:
            raise KVConnectorError(f"{request.seq_id}: {len(blocks)} blocks for "
                                   f"{num_external_tokens} external tokens, {len(found)} blocks "
                                   "matched")
        self.counters["device"]["hits"] += num_device // self.block_size
        for b, (tier, payload) in zip(blocks, found):
            self._loads.append((b, tier, payload))
            self.counters[tier]["hits"] += 1

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingMetadata:
        """Loads committed since the last step, and every block this step fills whose key no
        tier holds yet (once per key, even if two sequences fill it)."""
        store, bs = self._need_store(), self.block_size
        saves: list[tuple[int, BlockHash]] = []
        seen: set[BlockHash] = set()
        for sc in scheduler_output.scheduled:
            lo, hi = sc.start_pos // bs, (sc.start_pos + sc.num_new_tokens) // bs
            if hi <= lo:
                continue
            keys = self.block_hashes(sc.seq, hi)
            for i in range(lo, hi):
                if keys[i] not in seen and keys[i] not in store:
                    seen.add(keys[i])
                    saves.append((sc.seq.block_table[i], keys[i]))
        meta, self._loads = OffloadingMetadata(self._loads, saves), []
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> None:
        self._hashes.pop(request.seq_id, None)
        self._matched.pop(request.seq_id, None)

    # ---- worker side: per step ----------------------------------------------------------------
    def start_load_kv(self) -> None:
        """Move this step's payloads to the device, one stacked tensor per K / V / scale
        (``[n, L, ...]``); each layer's slice is scattered into its blocks by
        ``wait_for_layer_load``. Also index the blocks to save (``save_kv_layer``)."""
        meta = self._meta
        self._staged, self._saving, self._saved_layers, self._src = {}, {}, set(), None
        if not isinstance(meta, OffloadingMetadata):
            return
        dev = self._caches["k"][0].device
        if meta.saves:
            self._src = torch.tensor([b for b, _ in meta.saves], device=dev)
        if not meta.loads:
            return
        for name, ts in self._caches.items():
            self._staged[name] = torch.stack([p[name] for _, _, p in meta.loads]).to(ts[0].device)
        self._staged["_dst"] = torch.tensor([b for b, _, _ in meta.loads], device=dev)
        for _, tier, p in meta.loads:
            self.counters[tier]["loads"] += 1
            self.counters[tier]["bytes_loaded"] += payload_nbytes(p)

    def wait_for_layer_load(self, layer_idx: int) -> None:
        if not self._staged:
            return
        dst = self._staged["_dst"]
        for name, ts in self._caches.items():
            ts[layer_idx][dst] = self._staged[name][:, layer_idx]

    def save_kv_layer(self, layer_idx: int) -> None:
        src = self._src
        if src is None:
            return
        for name, ts in self._caches.items():
            if name not in self._saving:
                shape = (len(src), len(ts), *ts[0].shape[1:])
                self._saving[name] = torch.empty(shape, dtype=ts[0].dtype, device="cpu")
            self._saving[name][:, layer_idx] = ts[layer_idx][src].cpu()
        self._saved_layers.add(layer_idx)

    def wait_for_save(self) -> None:
        """Every layer saved its part: cut the buffers into one payload per block and store
        them (CPU, spilling to disk)."""
        meta, store = self._meta, self._need_store()
        self._staged = {}
        if self._src is None:
            return
        num_layers = len(self._caches["k"])
        if len(self._saved_layers) != num_layers:
            raise KVConnectorError(f"{len(self._saved_layers)} of {num_layers} layers saved "
                                   "their KV: the model must call its cache's attend per layer")
        for i, (_, key) in enumerate(meta.saves):
            store.put(key, {n: buf[i].clone() for n, buf in self._saving.items()})
        self._saving, self._saved_layers, self._src = {}, set(), None

    def reset_cache(self) -> None:
        self._need_store().clear()

    # ---- observability ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per tier: hits (blocks matched), loads / bytes_loaded (copied into the device),
        stores / bytes_stored, evictions, and the tier's current blocks and bytes; disk also
        counts corrupt files (dropped and recomputed). ``device`` counts prefix-cache hits."""
        out = {name: dict(c) for name, c in self.counters.items()}
        for tier in self._need_store().tiers():
            blocks = tier.blocks if tier.name == "cpu" else tier.files
            out[tier.name].update(blocks=len(blocks), bytes_used=tier.bytes_used,
                                  capacity_bytes=tier.capacity_bytes)
        return out

    def close(self) -> None:
        """Delete the disk tier's files (also done when the connector is garbage collected)."""
        if self.store is not None:
            self.store.close()
