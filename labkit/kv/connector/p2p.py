"""Prefill/decode disaggregation: a prefill engine pushes a request's KV to a decode engine.

Two connectors on the contract of :mod:`labkit.kv.connector.base`, one per ``kv_role``
(vLLM's ``kv_producer`` / ``kv_consumer``; SGLang's prefill / decode servers):

- :class:`P2PProducer` (the prefill instance) does nothing while a request runs. When a request
  that carries ``SamplingParams.kv_transfer_params = {"do_remote_decode": True, "remote_host":
  H, "remote_port": P}`` finishes, ``request_finished`` copies its full prompt blocks from the
  device (they are still the request's: the scheduler frees them right after this call) and
  pushes them to ``H:P`` (:mod:`.transfer`), waiting for the acknowledgement. So the blocks are
  freed once the decode side holds the KV, and a failed push (decode instance gone, refused,
  timed out) is counted and logged, never raised into the engine step.
- :class:`P2PConsumer` (the decode instance) listens on ``port`` and keeps received blocks in a
  CPU store keyed by their prefix-cache hashes; a request's prompt is then matched against that
  store at admission exactly as the offloading connector's CPU tier is (it *is* that
  connector, with the network as the only writer), and the matched blocks are loaded instead of
  computed. A request whose KV never arrived is simply computed: a lost transfer costs a
  prefill, never a wrong token.

Only full blocks move (the decode instance recomputes the last partial block and the last
token, which it needs for logits anyway); vLLM's NIXL connector also sends the partial block
and reads it by RDMA with the device blocks held until the decode side is done. Here the copy
is staged through host memory and synchronous, like every other KV copy in labkit.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from labkit.errors import EngineConfigError, KVConnectorError
from labkit.kv.connector.base import KVConnectorBase, KVConnectorMetadata
from labkit.kv.connector.offloading import OffloadingConnector, OffloadingMetadata
from labkit.kv.connector.tiers import Layout, Payload
from labkit.kv.connector.transfer import KVReceiver, encode_frame, send_blocks
from labkit.kv.prefix import BlockHash, hash_block_tokens

log = logging.getLogger("labkit.kv")


def _layout(kv_cache: Any) -> tuple[dict[str, list], Layout]:
    names = (("k", kv_cache.k_caches), ("v", kv_cache.v_caches),
             ("k_scale", kv_cache.k_scales), ("v_scale", kv_cache.v_scales))
    caches = {n: ts for n, ts in names if ts}
    return caches, {n: ((len(ts), *ts[0].shape[1:]), ts[0].dtype) for n, ts in caches.items()}


def remote_of(params: Any) -> tuple[str, int] | None:
    """``(host, port)`` a finished request's KV goes to, or None (not a disaggregated one)."""
    ktp = getattr(params, "kv_transfer_params", None)
    if not ktp or not ktp.get("do_remote_decode"):
        return None
    host, port = ktp.get("remote_host"), ktp.get("remote_port")
    if not isinstance(host, str) or not isinstance(port, int) or not 0 < port < 65536:
        raise KVConnectorError(f"kv_transfer_params needs remote_host (str) and remote_port "
                               f"(int), got {ktp!r}")
    return host, port


class P2PProducer(KVConnectorBase):
    """The prefill side (see the module doc). ``model`` names the weights for the receiver's
    compatibility check; ``timeout_s`` bounds one push."""

    def __init__(self, model: str = "", timeout_s: float = 5.0) -> None:
        super().__init__()
        self.model, self.timeout_s = model, timeout_s
        self._caches: dict[str, list] = {}
        self.layout: Layout = {}
        self.block_size = 0
        self.counters = {"requests": 0, "blocks": 0, "bytes": 0, "failed": 0}
        self.results: dict[str, dict[str, Any]] = {}  # request id -> push outcome (last 1024)

    def register_kv_caches(self, kv_cache: Any) -> None:
        if self._caches:
            raise EngineConfigError("this P2PProducer already serves an engine")
        self._caches, self.layout = _layout(kv_cache)
        self.block_size = kv_cache.block_size

    # nothing is loaded or saved while requests run
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, request: Any, blocks: list[int],
                                 num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KVConnectorMetadata()

    def start_load_kv(self) -> None:
        pass

    def wait_for_save(self) -> None:
        pass

    def request_finished(self, request: Any, block_ids: list[int]) -> None:
        """Push the finished request's full prompt blocks to its decode instance (a request
        that was aborted, or that names none, pushes nothing)."""
        rid = request.request.request_id
        try:
            remote = remote_of(request.request.params)
        except KVConnectorError as e:  # checked at add_request; never fail a step over it
            self.counters["failed"] += 1
            self._record(rid, {"ok": False, "error": str(e)})
            return
        if remote is None or request.finish_reason == "abort":
            return
        n = min((request.num_prompt_tokens - 1) // self.block_size, len(block_ids))
        blocks = list(zip(self._keys(request, n), self._payloads(block_ids[:n])))
        self.counters["requests"] += 1
        try:
            stored = send_blocks(*remote, encode_frame(self.model, self.layout, blocks),
                                 self.timeout_s)
        except (KVConnectorError, OSError, ValueError) as e:
            self.counters["failed"] += 1
            self._record(rid, {"ok": False, "error": str(e)})
            log.warning("KV push of %s to %s:%d failed: %s", rid, *remote, e)
            return
        self.counters["blocks"] += stored
        self.counters["bytes"] += sum(t.nbytes for _, p in blocks for t in p.values())
        self._record(rid, {"ok": True, "blocks": stored})

    def _record(self, rid: str, outcome: dict[str, Any]) -> None:
        """Keep the outcome of the last 1024 pushes (a long-running server must not grow)."""
        self.results[rid] = outcome
        while len(self.results) > 1024:
            del self.results[next(iter(self.results))]

    def _keys(self, seq: Any, n: int) -> list[BlockHash]:
        keys: list[BlockHash] = []
        bs, toks = self.block_size, seq.token_ids
        for i in range(n):
            keys.append(hash_block_tokens(keys[-1] if keys else None,
                                          toks[i * bs:(i + 1) * bs], seq.cache_salt))
        return keys

    def _payloads(self, block_ids: list[int]) -> list[Payload]:
        """Every layer of each block, on the host (one gather per layer and tensor)."""
        import torch

        if not block_ids:
            return []
        idx = torch.tensor(block_ids, device=self._caches["k"][0].device)
        stacked = {n: torch.stack([t[idx] for t in ts], dim=1).cpu()  # [n, L, ...]
                   for n, ts in self._caches.items()}
        return [{n: s[i].clone() for n, s in stacked.items()} for i in range(len(block_ids))]

    def stats(self) -> dict[str, Any]:
        return {"push": dict(self.counters)}


class P2PConsumer(OffloadingConnector):
    """The decode side (see the module doc): a CPU store of ``cpu_bytes`` filled by a
    :class:`~labkit.kv.connector.transfer.KVReceiver` on ``host:port`` (0: any free port,
    ``.port`` after the engine is built)."""

    def __init__(self, cpu_bytes: int = 256 << 20, host: str = "127.0.0.1", port: int = 0,
                 model: str = "", max_frame_bytes: int = 256 << 20) -> None:
        super().__init__(cpu_bytes=cpu_bytes)
        self.host, self.port, self.model = host, port, model
        self.max_frame_bytes = max_frame_bytes
        self.receiver: KVReceiver | None = None
        self._lock = threading.Lock()  # the receiver's threads put, the scheduler gets

    def register_kv_caches(self, kv_cache: Any) -> None:
        super().register_kv_caches(kv_cache)
        _, layout = _layout(kv_cache)
        self.receiver = KVReceiver(self.host, self.port, self.model, layout, self._received,
                                   self.max_frame_bytes)
        self.port = self.receiver.port

    def _received(self, blocks: list[tuple[BlockHash, Payload]]) -> None:
        store = self._need_store()
        with self._lock:
            for key, payload in blocks:
                store.put(key, payload)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        with self._lock:
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingMetadata:
        """Loads only: the store holds what prefill instances sent, not this engine's own
        blocks (those stay in its device prefix cache)."""
        meta, self._loads = OffloadingMetadata(self._loads, []), []
        return meta

    def reset_cache(self) -> None:
        with self._lock:
            super().reset_cache()

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.receiver is not None:
            out["receive"] = dict(self.receiver.counters)
        return out

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        super().close()


def make_p2p_connector(extra: dict[str, Any], role: str) -> KVConnectorBase:
    """``kv_transfer_config={"kv_connector": "p2p", "kv_role": "kv_producer" | "kv_consumer",
    "kv_connector_extra_config": {...}}``: the producer takes ``model``, ``timeout_s``; the
    consumer ``cpu_bytes``, ``host``, ``port``, ``model``, ``max_frame_bytes``."""
    cls = P2PProducer if role == "kv_producer" else P2PConsumer
    known = ({"model", "timeout_s"} if cls is P2PProducer else
             {"cpu_bytes", "host", "port", "model", "max_frame_bytes"})
    if set(extra) - known:
        raise EngineConfigError(f"unknown p2p connector settings for {role}: "
                                f"{sorted(set(extra) - known)}; valid: {sorted(known)}")
    return cls(**extra)
