"""Exercises: the distillation loss (temperature, the T² factor) and a 2:4 pruning mask.

Both checkers compare with labkit.compress (``kd_loss``, ``mask_2_4``) on fixed inputs, name the
classic mistakes when they recognise them, and then *train*: a few seeded optimizer steps of a
tiny student towards a tiny teacher with the learner's loss (or healing with the learner's
mask) must end where the same steps with the reference end.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from labkit.exercises.checks import CheckFailure, call, run_check

NOTEBOOK = "11_distillation_pruning"

CONTRACT_KD = '''
def distillation_loss(student_logits: Tensor, teacher_logits: Tensor,
                      temperature: float) -> Tensor:
    """Forward KL(p_teacher || q_student) between the temperature-softened distributions
    softmax(logits / T), summed over the vocabulary (last dim), averaged over every other
    position, multiplied by T². Returns a 0-d tensor that gradients flow through."""
'''

CONTRACT_MASK = '''
def mask_2_4(weight: Tensor) -> Tensor:
    """weight [out, in] (in divisible by 4) -> bool mask of the same shape, True = keep:
    in every run of 4 consecutive weights along a row, keep the 2 with the largest |w|."""
'''


def inject(name: str, learner_fn: Callable) -> Callable:
    """The reference solution under ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's."""
    if os.environ.get("LABKIT_INJECT_SOLUTIONS") != "1":
        return learner_fn
    from labkit.exercises import compression_solutions

    return getattr(compression_solutions, name)


def _logits(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2.5


def _tiny(seed: int, layers: int):
    from labkit.model.config import ModelConfig
    from labkit.model.llama import LlamaForCausalLM

    torch.manual_seed(seed)
    m = LlamaForCausalLM(ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.mul_(4)
    return m


def _train(loss_fn: Callable, steps: int = 5, temperature: float = 2.0,
           student=None, teacher=None, after_step: Callable | None = None):
    """A few seeded Adam steps of a student towards a teacher; returns the student."""
    teacher = teacher or _tiny(0, 2).eval()
    student = student or _tiny(1, 1)
    opt = torch.optim.Adam(student.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(7)
    for _ in range(steps):
        x = torch.randint(0, 64, (4, 16), generator=g)
        with torch.no_grad():
            t = teacher(x)
        loss = loss_fn(student(x), t, temperature)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if after_step is not None:
            after_step(student)
    return student


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max())
               for p, q in zip(a.parameters(), b.parameters()))


def check_distillation_loss(distillation_loss: Callable) -> object:
    from labkit.compress.distill import kd_loss

    def body() -> str:
        for T in (1.0, 2.0, 4.0):
            for shape in ((2, 5, 16), (7, 16)):
                s, t = _logits(1, shape), _logits(2, shape)
                ref = float(kd_loss(s, t, T))
                got = call(distillation_loss, s, t, T,
                           _label=f"distillation_loss(logits {list(shape)}, T={T})")
                if not isinstance(got, torch.Tensor) or got.numel() != 1:
                    raise CheckFailure("return a 0-d tensor", expected="tensor(…)", actual=got)
                val = float(got.detach())
                if abs(val - ref) <= 1e-4 * max(1.0, abs(ref)):
                    continue
                hint = "compare your formula with the contract"
                if T > 1 and abs(val * T * T - ref) <= 1e-4 * max(1.0, abs(ref)):
                    hint = "the T² factor is missing: the soft-target gradient shrinks like 1/T²"
                elif abs(val - float(kd_loss(s, t, T, "reverse"))) <= 1e-4 * max(1.0, ref):
                    hint = ("that is the reverse KL(q_student || p_teacher); the contract asks "
                            "for the teacher's distribution first")
                raise CheckFailure("wrong loss value", inputs=f"random logits {list(shape)}, "
                                   f"temperature {T}", expected=ref, actual=val, hint=hint)
        a = _train(lambda s, t, T: distillation_loss(s, t, T))
        b = _train(lambda s, t, T: kd_loss(s, t, T))
        diff = _max_diff(a, b)
        if diff > 1e-4:
            raise CheckFailure("five training steps with your loss end elsewhere than with the "
                               "reference", expected="max |Δw| < 1e-4", actual=diff,
                               hint="does the gradient flow (no .item(), no detach)?")
        return ("values match at T = 1, 2, 4, and five Adam steps of a tiny student with your "
                "loss land where the reference's do.")

    return run_check("distillation_loss", body)


def _signed_mask(w: torch.Tensor) -> torch.Tensor:
    """The 2 largest *signed* values of each run of 4 (a classic mistake)."""
    g = w.reshape(w.shape[0], -1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(-1, g.topk(2, dim=-1).indices, True)
    return keep.reshape(w.shape)


def check_mask_2_4(mask_2_4: Callable) -> object:
    from labkit.compress.distill import kd_loss
    from labkit.compress.prune import decoder_weights
    from labkit.compress.prune import mask_2_4 as ref_mask

    def body() -> str:
        for seed, shape in ((0, (4, 8)), (1, (16, 64)), (2, (3, 12))):
            w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
            got = call(mask_2_4, w.clone(), _label=f"mask_2_4(weight {list(shape)})")
            if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or \
                    got.shape != w.shape:
                raise CheckFailure("return a bool tensor shaped like the weight",
                                   expected=f"bool {list(shape)}", actual=got)
            if not torch.equal(got, ref_mask(w)):
                kept = got.reshape(shape[0], -1, 4).sum(-1)
                hint = "keep the 2 largest |w| of each run of 4"
                if bool((kept != 2).any()):
                    hint = "every run of 4 along a row must keep exactly 2"
                elif torch.equal(got, ~ref_mask(w)):
                    hint = "you kept the smallest |w|: the mask says what to KEEP"
                elif torch.equal(got, _signed_mask(w)):
                    hint = "rank by |w|, not by w: large negative weights matter as much"
                raise CheckFailure("wrong mask", inputs=f"weight {list(shape)} seed {seed}",
                                   expected=ref_mask(w), actual=got, hint=hint)
        teacher = _tiny(0, 2).eval()

        def healed(mask_fn):
            import copy

            student = copy.deepcopy(teacher)
            masks = {n: mask_fn(w.detach()) for n, w in decoder_weights(student).items()}

            def reapply(m):
                with torch.no_grad():
                    for n, w in decoder_weights(m).items():
                        w.mul_(masks[n])

            reapply(student)
            return _train(kd_loss, 3, 1.0, student, teacher, reapply)

        a, b = healed(mask_2_4), healed(ref_mask)
        diff = _max_diff(a, b)
        if diff > 1e-5:
            raise CheckFailure("pruning + 3 healing steps with your mask differ from the "
                               "reference", expected="max |Δw| < 1e-5", actual=diff)
        return ("exactly 2 of every 4 kept, the largest; pruning a tiny model with your mask "
                "and healing it 3 steps matches the reference.")

    return run_check("mask_2_4", body)
