"""Exercise: one continuous-batching scheduler step under a token budget, decode first.

Iteration-level scheduling (Orca, vLLM) decides every step which sequences run and how many
tokens each computes, under ``max_num_batched_tokens``. Running decodes go first (they are cheap,
one token each, and stalling them shows up as TPOT spikes); then unfinished prefills; then new
requests in arrival order, the last one possibly cut into a chunk (chunked prefill) so the budget
is used exactly.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace

from labkit.engine.sampling_params import SamplingParams
from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.shared import Seq, tiny_engine


def reference_schedule_step(running: list[Seq], waiting: list[Seq], token_budget: int,
                            max_num_seqs: int) -> dict[str, int]:
    """The checker's oracle: labkit's scheduler without preemption, policies or watermarks
    (the engine replay below shows the two agree step for step)."""
    plan: dict[str, int] = {}
    budget = token_budget
    for seq in running:  # decode first: one token each
        if seq.num_computed_tokens >= seq.num_prompt_tokens and budget > 0:
            plan[seq.seq_id] = 1
            budget -= 1
    for seq in running:  # then running prefills (chunked)
        left = seq.num_prompt_tokens - seq.num_computed_tokens
        if left > 0 and budget > 0:
            plan[seq.seq_id] = min(left, budget)
            budget -= plan[seq.seq_id]
    num_seqs = len(running)
    for seq in waiting:  # then admit in arrival order
        if budget == 0 or num_seqs >= max_num_seqs:
            break
        plan[seq.seq_id] = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
        budget -= plan[seq.seq_id]
        num_seqs += 1
    return plan


def _random_case(rng: random.Random) -> tuple[list[Seq], list[Seq], int, int]:
    running = []
    for i in range(rng.randint(0, 6)):
        prompt = rng.randint(1, 40)
        computed = prompt + rng.randint(0, 5) if rng.random() < 0.7 else rng.randint(0, prompt - 1)
        running.append(Seq(f"r{i}", prompt, computed))
    waiting = [Seq(f"w{i}", p, rng.randint(0, p - 1) if rng.random() < 0.2 else 0)
               for i, p in enumerate(rng.randint(1, 60) for _ in range(rng.randint(0, 6)))]
    budget = rng.choice([1, 3, 8, 16, 32, 64, 256])
    max_seqs = rng.randint(max(1, len(running)), len(running) + 4)
    return running, waiting, budget, max_seqs


HAND_CASES = [
    # decodes go first even when a prefill is ahead in the list
    ([Seq("a", 10, 4), Seq("b", 5, 5)], [], 4, 8),
    # the last admitted request gets a partial chunk
    ([Seq("a", 3, 3)], [Seq("w0", 10), Seq("w1", 10)], 8, 8),
    # max_num_seqs counts running sequences too
    ([Seq("a", 3, 3), Seq("b", 3, 3)], [Seq("w0", 2), Seq("w1", 2)], 100, 3),
    # a prefix hit means fewer prompt tokens are left to compute
    ([], [Seq("w0", 20, 16)], 64, 4),
    # budget smaller than the number of decodes
    ([Seq("a", 2, 2), Seq("b", 2, 3), Seq("c", 2, 2)], [Seq("w0", 4)], 2, 8),
]


def _hint(running: list[Seq], waiting: list[Seq], budget: int, max_seqs: int,
          expected: dict, actual: object) -> str:
    if not isinstance(actual, dict):
        return "return a dict {seq_id: num_tokens}."
    if sum(actual.values()) > budget:
        return "the tokens of a step must fit in token_budget."
    if any(v <= 0 for v in actual.values()):
        return "leave out sequences that get 0 tokens."
    decodes = [s.seq_id for s in running if s.num_computed_tokens >= s.num_prompt_tokens]
    if set(decodes) & set(expected) - set(actual):
        return "running decodes come first: each gets 1 token before any prefill is scheduled."
    if len(running) + sum(1 for s in waiting if s.seq_id in actual) > max_seqs:
        return "len(running) + admitted waiting sequences must stay <= max_num_seqs."
    for s in waiting:
        if s.seq_id in actual and s.seq_id in expected and actual[s.seq_id] != expected[s.seq_id]:
            left = s.num_prompt_tokens - s.num_computed_tokens
            if actual[s.seq_id] == s.num_prompt_tokens and left != s.num_prompt_tokens:
                return "num_computed_tokens are already cached: compute only the rest."
            return "chunked prefill: give the last admitted request whatever budget is left."
    if set(expected) - set(actual):
        return "budget is left and a sequence could use it (chunked prefill fills the budget)."
    if list(actual) != list(expected):
        return "keep the scheduling order: decodes, running prefills, then waiting in order."
    return "compare with the contract's three rules, in order."


def check(schedule_step: Callable[..., dict]) -> object:
    """Exact plans on hand-written and 300 random queue states."""

    def body() -> str:
        rng = random.Random(0)
        cases = list(HAND_CASES) + [_random_case(rng) for _ in range(300)]
        for running, waiting, budget, max_seqs in cases:
            r_copy, w_copy = [replace(s) for s in running], [replace(s) for s in waiting]
            expected = reference_schedule_step(r_copy, w_copy, budget, max_seqs)
            actual = call(schedule_step, r_copy, w_copy, budget, max_seqs)
            inputs = (f"running={running}\n            waiting={waiting}\n"
                      f"            token_budget={budget}, max_num_seqs={max_seqs}")
            if r_copy != running or w_copy != waiting:
                raise CheckFailure("your function modified its inputs", inputs=inputs,
                                   expected=(running, waiting), actual=(r_copy, w_copy),
                                   hint="plan only; the engine updates the sequences after "
                                        "the step runs.")
            if not isinstance(actual, dict) or actual != expected or \
                    list(actual) != list(expected):
                raise CheckFailure("wrong plan", inputs=inputs, expected=expected,
                                   actual=actual,
                                   hint=_hint(running, waiting, budget, max_seqs, expected,
                                              actual))
        steps = 0
        for seed, budget, max_seqs in ENGINE_RUNS:
            for running, waiting, labkit_plan in engine_states(seed, budget, max_seqs):
                actual = call(schedule_step, running, waiting, budget, max_seqs)
                if actual != labkit_plan or list(actual) != list(labkit_plan):
                    raise CheckFailure(
                        "on a real engine run, your plan differs from labkit's scheduler",
                        inputs=f"running={running}\n            waiting={waiting}\n"
                               f"            token_budget={budget}, max_num_seqs={max_seqs}",
                        expected=labkit_plan, actual=actual,
                        hint=_hint(running, waiting, budget, max_seqs, labkit_plan, actual))
                steps += 1
        return (f"{len(cases)} queue states planned right, and at all {steps} steps of "
                f"{len(ENGINE_RUNS)} real engine runs your plan equals labkit's scheduler: "
                "decode-first with chunked prefill, as vLLM V1 schedules.")

    return run_check("schedule_step", body)


ENGINE_RUNS = [(0, 16, 4), (3, 5, 2)]  # (seed, token budget, max_num_seqs)


def engine_states(seed: int, budget: int, max_seqs: int, num_requests: int = 8
                  ) -> list[tuple[list[Seq], list[Seq], dict[str, int]]]:
    """Run labkit's engine (tiny model, ample KV so nothing is preempted) and rebuild, from its
    trace, the queues before every step and the plan labkit's scheduler made for it."""
    engine = tiny_engine(num_blocks=256, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                         enable_prefix_caching=False)
    rng = random.Random(seed)
    prompt_len: dict[str, int] = {}
    for i in range(num_requests):
        n = rng.randint(1, 40)
        prompt_len[f"r{i}"] = n
        engine.add_request(f"r{i}", [rng.randrange(128) for _ in range(n)],
                           SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 10),
                                          ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    computed: dict[str, int] = {}
    finished: set[str] = set()
    states = []
    for step in engine.trace.to_dict()["steps"]:
        running = [Seq(s, prompt_len[s], c) for s, c in computed.items() if s not in finished]
        waiting = [Seq(s, n) for s, n in prompt_len.items() if s not in computed]
        plan = {e["seq_id"]: e["num_tokens"] for e in step["scheduled"]}
        states.append((running, waiting, plan))
        for e in step["scheduled"]:
            computed[e["seq_id"]] = computed.get(e["seq_id"], 0) + e["num_tokens"]
        finished.update(f["seq_id"] for f in step["finished"])
    return states
