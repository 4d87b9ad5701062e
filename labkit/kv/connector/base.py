"""The KV-connector contract (vLLM v1's ``KVConnectorBase_V1``): KV blocks in and out of an engine.

A connector lets KV that this engine did not just compute stand in for a prefill (loaded from a
CPU or disk tier, or from another instance), and lets KV this engine computed leave it (saved to
a tier, or sent to a decode instance). It has two sides, which vLLM runs in two processes and
which talk only through the per-step metadata:

**Scheduler side** (called by :class:`labkit.sched.scheduler.Scheduler`, no tensors):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)``: when a request is admitted,
   after the device prefix cache matched ``num_computed_tokens`` tokens, how many *more* tokens
   (whole blocks, never the last prompt token) the connector can supply;
2. ``update_state_after_alloc(request, blocks, num_external_tokens)``: the scheduler allocated
   ``blocks`` (fresh device blocks, one per matched block, in order) for those tokens and counts
   them as computed; the connector remembers to fill them;
3. ``build_connector_meta(scheduler_output)``: once per step, at the end of ``schedule()``: what
   the worker side must load and save this step (carried as
   ``SchedulerOutput.kv_connector_metadata``);
4. ``request_finished(request, block_ids)``: a request finished or was aborted; its blocks are
   freed right after (vLLM may delay that for an asynchronous send; labkit saves within the
   step that computed a block, so nothing is still reading them).

**Worker side** (called by :class:`labkit.engine.model_runner.ModelExecutor` around the forward):
``register_kv_caches(kv_cache)`` once; per step ``bind_connector_metadata(meta)``,
``start_load_kv()`` before the forward, per layer ``wait_for_layer_load(i)`` just before layer
i attends and ``save_kv_layer(i)`` just after it wrote its new K/V (the hooks
:func:`attach_layer_hooks` puts on that engine's cache), ``wait_for_save()`` after the forward,
``clear_connector_metadata()``. Layer granularity is vLLM's: a layer's copy can overlap the
previous layer's compute on a GPU.

Here one object plays both roles in one process (the engine builds one connector and hands it to
both sides); a "request" is the scheduler's :class:`~labkit.sched.request.Sequence` (sample).
Without a connector none of these calls happen and the engine runs exactly as before.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (subclassed per connector)."""


class KVConnectorBase(ABC):
    """Subclass and implement the abstract methods; the layer hooks are optional (a connector
    that moves whole blocks before and after the forward does it in ``start_load_kv`` and
    ``wait_for_save``)."""

    def __init__(self) -> None:
        self._meta: KVConnectorMetadata | None = None

    # ---- scheduler side -----------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Tokens beyond ``num_computed_tokens`` the connector can load: a multiple of the block
        size, at most ``len(request.token_ids) - 1 - num_computed_tokens`` (the last token is
        always computed, to have logits to sample from). vLLM also returns whether the load is
        asynchronous; labkit's loads finish before the forward that needs them."""

    @abstractmethod
    def update_state_after_alloc(self, request: Any, blocks: list[int],
                                 num_external_tokens: int) -> None:
        """``blocks`` are the device blocks allocated for the ``num_external_tokens`` matched
        tokens (``num_external_tokens // block_size`` of them, in prefix order)."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        """This step's loads and saves, for the worker side; resets the per-step state."""

    def request_finished(self, request: Any, block_ids: list[int]) -> None:  # noqa: B027
        """Forget per-request state; ``block_ids`` are freed right after this call."""

    # ---- worker side --------------------------------------------------------------------------
    @abstractmethod
    def register_kv_caches(self, kv_cache: Any) -> None:
        """The engine's :class:`~labkit.kv.cache.PagedKVCache` (its per-layer tensors)."""

    def bind_connector_metadata(self, meta: KVConnectorMetadata | None) -> None:
        self._meta = meta

    def clear_connector_metadata(self) -> None:
        self._meta = None

    @abstractmethod
    def start_load_kv(self) -> None:
        """Begin this step's loads into their device blocks (before the forward)."""

    def wait_for_layer_load(self, layer_idx: int) -> None:  # noqa: B027 - optional hook
        """Block until layer ``layer_idx``'s loads are in place (called just before it attends)."""

    def save_kv_layer(self, layer_idx: int) -> None:  # noqa: B027 - optional hook
        """Layer ``layer_idx`` has written this step's K/V: start saving its part."""

    @abstractmethod
    def wait_for_save(self) -> None:
        """Finish this step's saves (after the forward, before the blocks can be reused)."""

    def reset_cache(self) -> None:  # noqa: B027 - optional: a connector that stores nothing
        """Forget every stored block (``LLMEngine.reset_prefix_cache``: the weights changed,
        so KV stored under the same token keys is stale)."""

    # ---- observability ------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters for ``LLMEngine.stats()["kv_connector"]`` (empty by default)."""
        return {}


def attach_layer_hooks(kv_cache: Any, connector: KVConnectorBase) -> None:
    """Wrap this cache object's ``attend`` (the model's per-layer hook) so each layer waits for
    its loads first and offers its new K/V for saving after. Only the instance changes: an
    engine without a connector runs the class's ``attend`` with no extra call. A latent (MLA)
    layer's hook, ``attend_latent``, is wrapped the same way (its blocks are the latents)."""
    for name in ("attend", "attend_latent"):
        hook = getattr(type(kv_cache), name, None)
        if hook is not None:
            setattr(kv_cache, name, _with_connector(kv_cache, hook, connector))


def _with_connector(kv_cache: Any, hook: Any, connector: KVConnectorBase) -> Any:
    def attend_with_connector(layer_idx: int, *args: Any) -> Any:
        connector.wait_for_layer_load(layer_idx)
        out = hook(kv_cache, layer_idx, *args)
        connector.save_kv_layer(layer_idx)
        return out
    return attend_with_connector
