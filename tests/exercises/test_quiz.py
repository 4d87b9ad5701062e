"""check_answer: the four outcomes a learner sees, strict mode for CI, and the hand formulas the
notebooks' answer cells used to ship with, checked against labkit here instead."""

from __future__ import annotations

import pytest
import torch

from labkit.exercises.quiz import answers_match, check_answer

WHY = "count K and V"


def test_unanswered_is_a_reminder_not_an_error(capsys):
    result = check_answer("Q1", None, 42, why=WHY)
    assert not result.passed
    out = capsys.readouterr().out
    assert out.startswith("✎ Q1 not answered yet: edit the cell above")
    assert "42" not in out  # the reminder does not give the answer away


def test_unanswered_in_strict_mode_still_does_not_raise(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_STRICT_CHECKS", "1")
    assert not check_answer("Q1", None, 42, why=WHY).passed
    assert "not answered" in capsys.readouterr().out


def test_right_answer_prints_tick_and_explanation(capsys):
    result = check_answer("Q2", 1024, 1024, why=WHY, explain="1 KiB per token")
    assert result.passed and bool(result)
    assert capsys.readouterr().out.strip() == "✓ Q2: correct — 1 KiB per token"


def test_wrong_answer_reports_expected_given_and_hint_without_raising(capsys):
    result = check_answer("Q2", 2048, 1024, why=WHY)
    assert not result.passed
    out = capsys.readouterr().out
    assert out.startswith("✗ Q2:")
    assert "expected: 1024" in out and "actual:   2048" in out and f"hint:     {WHY}" in out


def test_wrong_kind_of_answer_says_so(capsys):
    assert not check_answer("Q3", "sixteen", 16, why=WHY).passed
    assert "expected a number, you gave a string" in capsys.readouterr().out


def test_strict_mode_raises_on_a_wrong_answer(monkeypatch):
    monkeypatch.setenv("LABKIT_STRICT_CHECKS", "1")
    with pytest.raises(AssertionError, match="expected: 1024"):
        check_answer("Q2", 2048, 1024, why=WHY)
    assert check_answer("Q2", 1024, 1024, why=WHY).passed  # a right one passes quietly on


def test_injected_solutions_use_the_truth(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_INJECT_SOLUTIONS", "1")
    assert check_answer("Q1", None, "sjf", why=WHY, explain="short jobs first").passed
    assert capsys.readouterr().out.startswith("✓ Q1: correct — short jobs first")
    with pytest.raises(AssertionError):  # a given wrong answer is still wrong, and strict
        check_answer("Q1", "fcfs", "sjf", why=WHY)


def test_injected_truth_that_cannot_equal_itself_fails_the_build(monkeypatch):
    monkeypatch.setenv("LABKIT_INJECT_SOLUTIONS", "1")
    with pytest.raises(AssertionError):
        check_answer("Q1", None, float("nan"), why=WHY)


@pytest.mark.parametrize(("answer", "truth", "kw", "ok"), [
    (0.5 / 127, 0.003936767578125, {}, True),          # fp16-stored scale vs the exact value
    (3.84, 4096 * 4096 * 2 / 8_732_672, {}, True),     # 3.8424 rounded to 3 digits
    (3.8, 4096 * 4096 * 2 / 8_732_672, {}, False),
    (0.52, 0.5, {"abs_tol": 0.03}, True),              # a statistical tolerance
    (0.55, 0.5, {"abs_tol": 0.03}, False),
    (7, 7, {}, True),
    (7.0, 7, {}, True),
    (8.9e6, 8_912_896, {}, False),                     # counts are exact
    (6, 7, {}, False),
    (" SJF ", "sjf", {}, True),
    ("fcfs", "sjf", {}, False),
    (True, True, {}, True),
    (1, True, {}, False),                              # a True/False question wants a bool
    (False, True, {}, False),
    (torch.tensor(3), 3, {}, True),                    # 0-d tensors compare as numbers
    (torch.tensor([3, 3]), 3, {}, False),
    ("3", 3, {}, False),
])
def test_answers_match(answer, truth, kw, ok):
    assert answers_match(answer, truth, **kw) is ok


# The hand-derived formulas the notebooks' answer cells used to contain, against labkit.

def test_hand_formulas_equal_labkit():
    from labkit.kv.cache import kv_bytes_per_block
    from labkit.quant.memory import linear_bytes
    from labkit.sim.presets import MODELS
    from labkit.spec.theory import expected_speedup, expected_tokens_per_step

    assert MODELS["llama-2-7b"].kv_bytes_per_token == 2 * 32 * 32 * 128 * 2            # 01 Q1
    assert linear_bytes(4096, 4096, "gptq") == (                                         # 04 Q1
        4096 * 4096 // 2 + 32 * 4096 * 2 + 32 * 4096 // 2 + 4 * 4096)
    assert abs(expected_tokens_per_step(0.8, 4) - (1 - 0.8 ** 5) / (1 - 0.8)) < 1e-9      # 05 Q1
    assert max(range(1, 9), key=lambda g: expected_speedup(0.6, g, 0.1)) == 3             # 05 Q2
    assert 64 * 4096 * kv_bytes_per_block(1, 1, 8, 128, torch.float16) == (              # 06 Q1
        2 * 64 * 4096 * 8 * 128 * 2)
    ideal = linear_bytes(8192, 8192, "fp16") / linear_bytes(8192, 8192, "gptq")          # 06 Q2
    assert abs(ideal - 8192 * 8192 * 2 / (8192 * 8192 / 2 + 64 * 8192 * 2 + 64 * 8192 / 2
                                          + 4 * 8192)) < 1e-9


def test_result_is_a_check_result_that_jupyter_does_not_echo(capsys):
    from labkit.exercises.checks import CheckResult

    result = check_answer("Q1", 1, 1, why=WHY)
    assert isinstance(result, CheckResult) and result.message == "✓ Q1: correct"
    assert result._ipython_display_() is None and capsys.readouterr().out == "✓ Q1: correct\n"
