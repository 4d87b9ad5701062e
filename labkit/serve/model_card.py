"""What a client can learn about the server it talks to, and the server-wide ``--seed``.

``GET /v1/models`` lists the served model as OpenAI does, plus (as vLLM adds ``max_model_len``)
a ``labkit`` object naming the engine features the server was started with: quantization,
speculative decoding, KV-cache dtype, attention backend, prefix caching, seed. A client (or a
learner comparing two servers) then knows what produced the numbers it gets.

``--seed S`` (vLLM's flag): a request without its own ``seed`` gets one drawn from a generator
seeded with S, in arrival order. A restarted server given the same requests in the same order
samples the same text; without ``--seed`` unseeded requests draw fresh entropy. Greedy
requests are unaffected either way.
"""

from __future__ import annotations

import random
from typing import Any


def model_card(model_name: str, max_model_len: int | None, features: dict[str, Any]
               ) -> dict[str, Any]:
    """One entry of ``/v1/models``'s ``data``."""
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "labkit",
            "max_model_len": max_model_len, "labkit": dict(features)}


def seeder(seed: int | None) -> random.Random | None:
    """The server's generator of request seeds (None: no ``--seed``)."""
    return None if seed is None else random.Random(seed)


def assign_seed(rng: random.Random | None, params: Any) -> None:
    """Give an unseeded request its seed from the server's generator."""
    if rng is not None and getattr(params, "seed", None) is None:
        params.seed = rng.randrange(2**63)
