"""Your ``schedule_step`` drives the real model: continuous batching with chunked prefill.

Each iteration asks *your* scheduler for a plan ({seq_id: tokens to compute}), runs exactly those
chunks in one packed forward through the paged KV cache (``ModelRunner.forward``),
samples greedily for every sequence whose prompt is now complete, and retires finished ones,
so new requests join the very next step. KV blocks are reserved per request up front to keep
the focus on scheduling (``allocator_engine`` exercises the blocks). If a plan breaks the budget,
computes a prompt token twice or skips one, or stalls, the check stops at that step and shows
the queues; if the plan is legal, the tokens must equal reference generation's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from labkit.engine.model_runner import ModelRunner
from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.shared import Seq
from labkit.kv.attention import get_attention_backend
from labkit.model.generate import generate
from labkit.model.testing import tiny_model


@dataclass
class _Request:
    seq_id: str
    prompt: list[int]
    block_table: list[int]
    computed: int = 0  # tokens whose KV is in the cache
    output: list[int] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    def view(self) -> Seq:
        return Seq(self.seq_id, len(self.prompt), self.computed)


@torch.inference_mode()
def generate_with_scheduler(schedule_step: Callable[..., dict], model: torch.nn.Module,
                            prompts: list[list[int]], *, max_new_tokens: int = 6,
                            token_budget: int = 16, max_num_seqs: int = 3,
                            block_size: int = 4) -> tuple[dict[str, list[int]], list[int]]:
    """Greedy generation for every prompt, one engine step per ``schedule_step`` plan.
    Returns (new tokens per request id ``"r{i}"``, tokens computed at each step)."""
    per_seq = -(-(max(map(len, prompts)) + max_new_tokens) // block_size)
    ex = ModelRunner.for_model(model, block_size, per_seq * len(prompts), 0,
                               get_attention_backend("torch"))
    waiting = [_Request(f"r{i}", list(p), list(range(i * per_seq, (i + 1) * per_seq)))
               for i, p in enumerate(prompts)]
    running: list[_Request] = []
    done: dict[str, list[int]] = {}
    step_tokens: list[int] = []
    while waiting or running:
        state = (f"step {len(step_tokens)}: running={[r.view() for r in running]}\n"
                 f"            waiting={[r.view() for r in waiting]}\n"
                 f"            token_budget={token_budget}, max_num_seqs={max_num_seqs}")
        plan = call(schedule_step, [r.view() for r in running], [r.view() for r in waiting],
                    token_budget, max_num_seqs, _label="schedule_step(...)")
        chosen = _validate(plan, running, waiting, token_budget, max_num_seqs, state)
        chunks, rows = [], []
        for req, n in chosen:
            start = req.computed
            chunks.append((req.block_table, start, req.tokens[start:start + n]))
            rows.append([n - 1])
        logits = ex.forward(chunks, rows)
        for (req, n), row in zip(chosen, logits):
            req.computed += n
            if req in waiting:
                waiting.remove(req)
                running.append(req)
            if req.computed >= len(req.prompt):  # prompt done: this step's logit is a token
                req.output.append(int(row.float().argmax()))
                if len(req.output) == max_new_tokens:
                    running.remove(req)
                    done[req.seq_id] = req.output
        step_tokens.append(sum(n for _, n in chosen))
    return done, step_tokens


def _validate(plan: object, running: list[_Request], waiting: list[_Request], budget: int,
              max_seqs: int, state: str) -> list[tuple[_Request, int]]:
    """The plan as (request, tokens) pairs, or a CheckFailure saying which rule it breaks."""
    def fail(what: str, hint: str) -> CheckFailure:
        return CheckFailure(what, inputs=state, expected="a plan within the rules in the hint",
                            actual=plan, hint=hint)

    if not isinstance(plan, dict) or not plan:
        raise fail("no work planned while requests are unfinished: the engine would hang",
                   "schedule at least one token per step while any sequence has work left; a "
                   "prompt longer than the budget only ever runs in chunks (chunked prefill).")
    by_id = {r.seq_id: r for r in running + waiting}
    chosen = []
    for sid, n in plan.items():
        req = by_id.get(sid)
        if req is None or not isinstance(n, int) or n <= 0:
            raise fail(f"bad entry {sid!r}: {n!r}", "keys are seq_ids from the queues, values "
                       "are positive token counts.")
        left = len(req.prompt) - req.computed
        if (left <= 0 and n != 1) or (left > 0 and n > left):
            raise fail(f"{sid} cannot compute {n} tokens now",
                       "a decoding sequence computes exactly 1 token; a prefill at most the "
                       "prompt tokens it has left (num_prompt_tokens - num_computed_tokens).")
        chosen.append((req, n))
    if sum(n for _, n in chosen) > budget:
        raise fail("the plan exceeds token_budget", "sum of the plan's values <= token_budget.")
    admitted = sum(1 for r, _ in chosen if r in waiting)
    if len(running) + admitted > max_seqs:
        raise fail("more sequences than max_num_seqs", "running + admitted <= max_num_seqs.")
    return chosen


def check_on_model(schedule_step: Callable[..., dict], model: torch.nn.Module | None = None,
                   ) -> object:
    """Run the model under your scheduler; compare every request with reference generation."""

    def body() -> str:
        m = model if model is not None else tiny_model()
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, m.config.vocab_size, (n,), generator=g).tolist()
                   for n in (5, 23, 2, 11, 40, 7)]
        budget, max_seqs = 16, 3
        got, steps = generate_with_scheduler(lambda r, w, b, s: schedule_step(
            [replace(x) for x in r], [replace(x) for x in w], b, s), m, prompts,
            token_budget=budget, max_num_seqs=max_seqs)
        for i, prompt in enumerate(prompts):
            want = generate(m, prompt, 6, ignore_eos=True)
            if got.get(f"r{i}") != want:
                raise CheckFailure(f"request r{i} generated different tokens",
                                   inputs=f"prompt r{i} = {prompt}", expected=want,
                                   actual=got.get(f"r{i}"),
                                   hint="a legal plan cannot change the tokens: look for a "
                                        "prompt chunk computed out of order.")
        total = sum(len(p) for p in prompts) + len(prompts) * 5
        return (f"your scheduler ran {len(prompts)} requests on the model in {len(steps)} steps "
                f"({total} tokens, {total / len(steps):.1f} per step of a {budget}-token budget, "
                f"at most {max_seqs} sequences); every token equals reference generation.")

    return run_check("schedule_step_engine", body, record=False)
