"""DistillSpec training text: line-start prompts that avoid the evaluation prompts, teacher
continuations in input order equal to the reference `generate`, the teacher-argmax hard label."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from labkit.compress.distill import DistillConfig, distill_loss
from labkit.compress.spec_data import eval_lines, line_prompts, teacher_generations
from labkit.model.generate import generate
from labkit.model.testing import tiny_model

TEXTS = ["import os\nimport sys\n\n\ndef walk(top):\n    for x in top:\n        yield x\n",
         "class Stack:\n    def push(self, x):\n        self.items.append(x)\n    return 1\n"]


def test_line_prompts_start_at_lines_and_skip_excluded_lines():
    exclude = {"def walk(top):"}
    ps = line_prompts(TEXTS, 40, exclude, seed=3)
    assert ps == line_prompts(TEXTS, 40, exclude, seed=3)  # deterministic
    for p in ps:
        assert p.endswith("\n") and "def walk(top):" not in p
        assert any(p in t for t in TEXTS) and any(t.startswith(p) or "\n" + p in t for t in TEXTS)
    with pytest.raises(ValueError, match="avoid the excluded"):
        line_prompts(TEXTS, 5, {ln.strip() for t in TEXTS for ln in t.splitlines()})


def test_eval_lines_hold_the_code_prompts_lines():
    lines = eval_lines(["code_prompts"])
    assert "def fibonacci(n):" in lines and "" not in lines


def test_teacher_generations_keep_order_and_equal_greedy_reference():
    model = tiny_model(0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8], [9, 10]]
    temps = [0.0, 0.0, 1.0, 0.0]
    out = teacher_generations(model, prompts, 12, temps, batch=2, progress=False)
    assert out.shape == (4, 12)
    for i in (0, 1, 3):  # greedy rows: exactly the reference continuation, in input order
        p = prompts[i]
        assert out[i].tolist() == p + generate(model, p, 12 - len(p), ignore_eos=True)
    assert out[2, :3].tolist() == prompts[2]
    with pytest.raises(ValueError, match="temperatures"):
        teacher_generations(model, prompts, 12, [0.0], progress=False)
    with pytest.raises(ValueError, match="1 .. 11 tokens"):
        teacher_generations(model, [list(range(12))], 12, [0.0], progress=False)


def test_teacher_hard_label_is_the_teacher_argmax():
    gen = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 5, 11, generator=gen), torch.randn(2, 5, 11, generator=gen)
    y = torch.randint(0, 11, (2, 5), generator=gen)  # ignored with hard_label="teacher"
    got = distill_loss(s, t, y, DistillConfig(hard_weight=1.0, hard_label="teacher"))
    want = F.cross_entropy(s.flatten(0, 1), t.argmax(-1).flatten())
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    with pytest.raises(ValueError, match="hard_label"):
        DistillConfig(hard_label="oracle")
