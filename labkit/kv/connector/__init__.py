"""KV connectors: KV blocks in and out of one engine (vLLM v1's ``kv_transfer`` package).

- :mod:`.base`: the contract (:class:`KVConnectorBase`: scheduler side and worker side) and the
  per-layer hooks on the paged cache;
- :mod:`.offloading`: :class:`OffloadingConnector`, a tiered prefix cache (device -> CPU ->
  disk) over :mod:`.tiers`;
- :mod:`.p2p`: :class:`P2PProducer` / :class:`P2PConsumer`, prefill/decode disaggregation
  (a prefill engine pushes a finished request's KV to a decode engine, :mod:`.transfer`).

An engine gets one through its config (vLLM's ``kv_transfer_config``)::

    LLM(model, kv_transfer_config={"kv_connector": "offloading",
                                   "kv_connector_extra_config": {"cpu_bytes": 1 << 30}})
    LLM(model, kv_connector=OffloadingConnector(cpu_bytes=1 << 30))   # an object

:func:`create_kv_connector` resolves the name through a registry
(:func:`register_kv_connector`), so a connector living higher up plugs in without the engine
importing it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.errors import EngineConfigError
from labkit.kv.connector.base import KVConnectorBase, KVConnectorMetadata, attach_layer_hooks
from labkit.kv.connector.offloading import OffloadingConnector, OffloadingMetadata
from labkit.kv.connector.p2p import P2PConsumer, P2PProducer, make_p2p_connector

__all__ = ["KVConnectorBase", "KVConnectorMetadata", "OffloadingConnector", "OffloadingMetadata",
           "P2PConsumer", "P2PProducer", "attach_layer_hooks", "create_kv_connector",
           "register_kv_connector"]

# name -> (factory from kv_connector_extra_config and the kv_role, the kv_roles it serves)
_Factory = Callable[[dict[str, Any], str], KVConnectorBase]
_REGISTRY: dict[str, tuple[_Factory, tuple[str, ...]]] = {}


def register_kv_connector(name: str, factory: _Factory,
                          roles: tuple[str, ...] = ("kv_both",)) -> None:
    """Make ``kv_transfer_config={"kv_connector": name, ...}`` build
    ``factory(extra, kv_role)``."""
    _REGISTRY[name] = (factory, roles)


def create_kv_connector(config: Any) -> KVConnectorBase:
    """The connector a :class:`labkit.config.KVTransferConfig` names (or holds)."""
    c = config.kv_connector
    if isinstance(c, KVConnectorBase):
        if config.kv_connector_extra_config:
            raise EngineConfigError("kv_connector_extra_config goes with a connector *name*; "
                                    "a connector object is already configured")
        return c
    if not isinstance(c, str) or c not in _REGISTRY:
        raise EngineConfigError(f"unknown kv_connector {c!r}; registered: {sorted(_REGISTRY)} "
                                "(or pass a KVConnectorBase object)")
    factory, roles = _REGISTRY[c]
    if config.kv_role not in roles:
        raise EngineConfigError(f"kv_connector {c!r} serves kv_role {roles}, not "
                                f"{config.kv_role!r}")
    return factory(dict(config.kv_connector_extra_config), config.kv_role)


for _name in ("offloading", "OffloadingConnector"):  # labkit's name and vLLM's
    register_kv_connector(_name, lambda extra, role: OffloadingConnector.from_extra_config(extra))
register_kv_connector("p2p", make_p2p_connector, roles=("kv_producer", "kv_consumer"))
