"""Attention sinks: one learned logit per head that joins the softmax and carries no value.

**What.** gpt-oss gives each attention head a parameter ``sinks[h]``. The softmax over a query's
visible keys gets one more term in its denominator, ``exp(sinks[h])``, that belongs to no key::

    p_j = exp(s_j) / (exp(sinks[h]) + sum_i exp(s_i))        # s_j = q.k_j * scale
    out = sum_j p_j v_j                                       # the sink adds nothing here

so the weights of the real keys sum to *less* than 1; the rest "goes to the sink".

**Why.** Without a sink softmax must put all of a head's attention somewhere, and trained
models learn to dump it on the first tokens (StreamingLLM's "attention sinks", Xiao et al.
2023). A sliding window evicts those tokens, so the mass they absorbed is spread over whatever
is left and the output drifts. A learned sink logit gives the mass a place that never leaves
the window: a head can attend to "nothing" whatever the window holds, which keeps gpt-oss's
128-token sliding layers stable. The sink enters the denominator only, so it needs no KV slot
(nothing is cached for it) and decoding and prefill handle it identically.

This module imports only torch: the model's reference attention
(:func:`labkit.model.llama.causal_attention`) and the paged torch backend
(:class:`labkit.kv.attention.TorchBackend`) both call :func:`attention_with_sinks`.
"""

from __future__ import annotations

import torch


def attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                         scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """softmax([q.k * scale | sink]) without the sink's column, times v, in float32.

    q [B,Hq,T,D], k/v [B,Hkv,S,D] (grouped-query: each kv head serves Hq/Hkv query heads),
    mask bool broadcastable to [B,Hq,T,S] (True = visible), sinks [Hq]. Returns [B,Hq,T,D] in
    q's dtype. A row that sees no key at all gets zeros (all its mass goes to the sink)."""
    B, Hq, T, _ = q.shape
    group = Hq // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, Hq, 1, 1).expand(B, Hq, T, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (probs @ v.float()).to(q.dtype)
