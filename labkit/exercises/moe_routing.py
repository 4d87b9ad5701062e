"""Exercise: an MoE layer's router and its dispatch/combine permutation, checked on a real model.

Three functions, the three steps of every mixture-of-experts layer (``labkit.model.moe``):

* ``topk_gating(router_logits, top_k, renormalize)``: softmax over ALL experts in float32, keep
  the k largest, and (Mixtral; Qwen iff ``norm_topk_prob``) divide them by their sum.
* ``dispatch(topk_ids, num_experts)``: the permutation that groups the T*k routing slots by
  expert (slot ``t*k + j`` is token t's j-th choice), and each expert's slot count, so every
  expert runs once over one contiguous block of rows (what a fused kernel pads to blocks).
* ``combine(expert_out, order, topk_weights, num_tokens)``: undo it: row i of ``expert_out``
  belongs to slot ``order[i]``; weight it and add it into its token.

The checker hooks every MoE layer of ``labkit-tiny-moe`` while it reads real Python code, and
compares the learner's three functions with the layer's own ``route`` (under both renormalisation
settings) and its experts' output. It names the classic mistakes: softmax over the k kept logits
(equal to the right answer WITH renormalisation, wrong without: the check tries both), a missing
renormalisation, and a combine that writes rows back in dispatch order instead of to their
tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.inject import inject as _inject
from labkit.model.moe import SparseMoeBlock, moe_blocks

MODEL = "labkit-tiny-moe"
PROMPT = 'def read_config(path):\n    """Parse an INI file into a dict."""\n    with open(path'


def inject(name: str, learner: Callable) -> Callable:
    """The reference under ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's own."""
    return _inject(name, learner, "moe_routing_solutions")


@dataclass
class LayerCase:
    """What one MoE layer saw and did in one forward: its input, block, and output."""

    layer: int
    block: SparseMoeBlock
    x: torch.Tensor  # [T, H] the layer's input
    out: torch.Tensor  # [T, H] the layer's output (experts' weighted sum)


def real_cases(model_name: str = MODEL, prompt: str = PROMPT) -> list[LayerCase]:
    """Run the shipped MoE over a code prompt and capture every MoE layer's input and output."""
    from labkit.model.loader import load_pretrained

    model, tok = load_pretrained(model_name, dtype=torch.float32, device="cpu")
    seen: dict[int, list[torch.Tensor]] = {}
    hooks = [b.register_forward_hook(
        lambda m, a, o: seen.__setitem__(m.layer_idx, [a[0].reshape(-1, a[0].shape[-1]),
                                                       o.reshape(-1, o.shape[-1])]))
        for b in moe_blocks(model)]
    with torch.no_grad():
        model(torch.tensor([tok.encode(prompt)]))
    for h in hooks:
        h.remove()
    return [LayerCase(b.layer_idx, b, *seen[b.layer_idx]) for b in moe_blocks(model)]


def reference_route(block: SparseMoeBlock, x: torch.Tensor,
                    renormalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's own ``route`` with ``norm_topk_prob`` set to `renormalize`."""
    saved = block.norm_topk_prob
    block.norm_topk_prob = renormalize
    try:
        with torch.no_grad():
            return block.route(x)
    finally:
        block.norm_topk_prob = saved


def run_experts(block: SparseMoeBlock, x: torch.Tensor, order: torch.Tensor,
                counts: list[int], top_k: int) -> torch.Tensor:
    """Each expert's SwiGLU over its contiguous block of dispatched rows: [T*k, H]."""
    w13, w2 = block.experts.gate_up_proj, block.experts.down_proj
    rows = x.index_select(0, order // top_k)
    out, start = torch.empty_like(rows), 0
    with torch.no_grad():
        for e, n in enumerate(counts):
            gate, up = F.linear(rows[start:start + n], w13[e]).chunk(2, dim=-1)
            out[start:start + n] = F.linear(F.silu(gate) * up, w2[e])
            start += n
    return out


def _check_gating(topk_gating: Callable, case: LayerCase) -> None:
    logits = case.block.gate(case.x).detach()
    k = case.block.top_k
    for renorm in (True, False):
        ref_logits, ref_w, ref_ids = reference_route(case.block, case.x, renorm)
        got = call(topk_gating, logits.clone(), k, renorm)
        if not (isinstance(got, tuple) and len(got) == 2):
            raise CheckFailure("topk_gating must return (weights, ids)", expected="a 2-tuple",
                               actual=type(got).__name__)
        w, ids = got
        where = f"layer {case.layer}, {logits.shape[0]} tokens, top_k={k}, renormalize={renorm}"
        if tuple(ids.shape) != tuple(ref_ids.shape) or not torch.equal(ids.long(), ref_ids):
            raise CheckFailure("wrong experts chosen", inputs=where, expected=ref_ids,
                               actual=ids, hint="the k largest router scores per token, best "
                               "first (torch.topk).")
        if not torch.allclose(w.float(), ref_w, rtol=1e-5, atol=1e-6):
            raise CheckFailure("wrong routing weights", inputs=where, expected=ref_w, actual=w,
                               hint=_gating_hint(logits, k, renorm, w))


def _gating_hint(logits: torch.Tensor, k: int, renorm: bool, w: torch.Tensor) -> str:
    sums = w.float().sum(-1)
    if renorm and not torch.allclose(sums, torch.ones_like(sums), atol=1e-5):
        return ("with renormalize=True the k weights of a token must sum to 1: divide them by "
                "their sum (Mixtral always does; Qwen when norm_topk_prob is true).")
    if not renorm and torch.allclose(sums, torch.ones_like(sums), atol=1e-5):
        return ("the weights sum to 1 without renormalisation: the softmax must run over ALL "
                "experts BEFORE top-k (a softmax over the k kept logits equals it only when the "
                "weights are renormalised afterwards, which is why Mixtral's code can do either).")
    return "softmax(router_logits) in float32 over every expert, then topk, then (maybe) divide."


def _check_permutation(dispatch: Callable, case: LayerCase,
                       ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    E, n = case.block.experts.num_experts, ids.numel()
    got = call(dispatch, ids.clone(), E)
    if not (isinstance(got, tuple) and len(got) == 2):
        raise CheckFailure("dispatch must return (order, counts)", expected="a 2-tuple",
                           actual=type(got).__name__)
    order, counts = got[0].long(), [int(c) for c in got[1]]
    ref_counts = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    if counts != ref_counts:
        raise CheckFailure("wrong slot count per expert", inputs=f"layer {case.layer}",
                           expected=ref_counts, actual=counts,
                           hint="count every (token, choice) slot: bincount(topk_ids.flatten()).")
    if order.numel() != n or not torch.equal(order.sort().values, torch.arange(n)):
        raise CheckFailure("order is not a permutation of the T*k slots",
                           inputs=f"layer {case.layer}", expected=f"each of 0..{n - 1} once",
                           actual=order, hint="slot t*k+j is token t's j-th choice.")
    experts_in_order = ids.reshape(-1)[order]
    if not bool((experts_in_order[1:] >= experts_in_order[:-1]).all()):
        raise CheckFailure("slots are not grouped by expert", inputs=f"layer {case.layer}",
                           expected="experts non-decreasing along order",
                           actual=experts_in_order, hint="argsort the flattened topk_ids.")
    return order, counts


def check(topk_gating: Callable, dispatch: Callable, combine: Callable) -> object:
    """All three on every MoE layer of labkit-tiny-moe: gating = the layer's own route (both
    renormalisation settings), the permutation groups slots by expert, and combining the
    experts' rows reproduces the layer's output (float32, 1e-5)."""

    def body() -> str:
        cases = real_cases()
        for case in cases:
            _check_gating(topk_gating, case)
            _, w, ids = reference_route(case.block, case.x, case.block.norm_topk_prob)
            order, counts = _check_permutation(dispatch, case, ids)
            rows = run_experts(case.block, case.x, order, counts, case.block.top_k)
            y = call(combine, rows.clone(), order.clone(), w.clone(), case.x.shape[0])
            if tuple(y.shape) != tuple(case.out.shape) or not torch.allclose(
                    y.float(), case.out, rtol=1e-5, atol=1e-5):
                raise CheckFailure(
                    "combine does not reproduce the layer's output", inputs=f"layer "
                    f"{case.layer}, {case.x.shape[0]} tokens", expected=case.out, actual=y,
                    hint="row i belongs to slot order[i], i.e. token order[i] // k and choice "
                    "order[i] % k: scale it by topk_weights at that slot and index_add it into "
                    "THAT token (not into row i's position in the sorted order).")
        T = cases[0].x.shape[0]
        return (f"your router and permutation reproduce all {len(cases)} MoE layers of {MODEL} "
                f"on {T} real tokens.")

    return run_check("moe_routing", body)
