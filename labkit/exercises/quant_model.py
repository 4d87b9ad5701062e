"""Your quantizer runs the model: every linear layer of labkit-tiny goes through your
quantize -> dequantize, and the next-token distributions are compared with full precision.

The number that matters is not the weight error but what it does to the model: the mean KL
divergence of the next-token distribution from the fp32 model on held-out-style text, side by side
with labkit's own implementation of the same format.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.model.loader import load_pretrained
from labkit.quant.rtn import dequantize_int8 as ref_dequantize_int8
from labkit.quant.rtn import fake_quantize, quantize_int8

Fake = Callable[[torch.Tensor], torch.Tensor]  # weight -> quantized-then-dequantized weight


def _model() -> tuple[torch.nn.Module, list[int]]:
    """labkit-tiny (shipped in datasets/models): real text statistics, a real code prompt."""
    model, tok = load_pretrained("labkit-tiny", dtype=torch.float32)
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1)"
    return model.eval(), tok.encode(text)


def _quantized(model: torch.nn.Module, fake: Fake, label: str) -> torch.nn.Module:
    q = copy.deepcopy(model)
    for name, mod in q.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            w = mod.weight.data
            w_hat = call(fake, w.clone(), _label=f"{label} on {name}.weight {list(w.shape)}")
            if not isinstance(w_hat, torch.Tensor) or w_hat.shape != w.shape:
                raise CheckFailure(f"{label} returned the wrong shape for {name}",
                                   expected=list(w.shape), actual=getattr(w_hat, "shape", w_hat))
            mod.weight.data = w_hat.to(w.dtype)
    return q


@torch.inference_mode()
def _kl(ref: torch.nn.Module, model: torch.nn.Module, tokens: list[int]) -> float:
    x = torch.tensor([tokens])
    p = torch.log_softmax(ref(x).float(), -1)
    q = torch.log_softmax(model(x).float(), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def check_on_model(fmt: str, learner_fake: Fake, reference_fake: Fake) -> object:
    """Compare next-token KL vs fp32 of the learner's and labkit's versions of format ``fmt``."""

    def body() -> str:
        model, tokens = _model()
        mine = _kl(model, _quantized(model, learner_fake, f"your {fmt}"), tokens)
        ref = _kl(model, _quantized(model, reference_fake, f"labkit's {fmt}"), tokens)
        if not mine <= 1.25 * ref + 1e-6:
            raise CheckFailure(f"your {fmt} model drifts further from fp32 than labkit's",
                               inputs=f"{len(tokens)} tokens of text", expected=f"KL <= {ref:.2e}"
                               " (labkit's, +25%)", actual=f"KL = {mine:.2e}",
                               hint="run the unit check first; a wrong group or scale layout "
                                    "shows up here as a large KL.")
        return (f"every linear of the model through your {fmt}: next-token KL vs fp32 "
                f"{mine:.2e} (labkit's {ref:.2e}).")

    return run_check(f"{fmt}_model", body, record=False)


def check_int8_on_model(quantize_int8_per_channel: Callable, dequantize_int8: Callable) -> object:
    return check_on_model("int8", lambda w: dequantize_int8(*quantize_int8_per_channel(w)),
                          lambda w: ref_dequantize_int8(*quantize_int8(w)))


def check_int4_on_model(quantize_int4_groupwise: Callable, dequantize_int4_groupwise: Callable,
                        group_size: int = 32) -> object:
    return check_on_model(
        "int4", lambda w: dequantize_int4_groupwise(*quantize_int4_groupwise(w, group_size),
                                                    group_size),
        lambda w: fake_quantize(w, 4, group_size))
