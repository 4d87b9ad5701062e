"""`labkit distill` end to end on the shipped pair, a few steps on a small corpus slice."""

import json

import pytest
import torch

from labkit.compress.card import expected_acceptance_rate


def test_expected_acceptance_rate_hand_computed():
    assert expected_acceptance_rate(0.5, 2) == pytest.approx((0.5 + 0.25) / 2)
    assert expected_acceptance_rate(1.0, 4) == 1.0


@pytest.mark.slow
def test_distill_cli_writes_a_loadable_model_with_its_card(tmp_path):
    from labkit.cli import main
    from labkit.model.loader import load_pretrained, resolve_model_path
    from labkit.train.data import prepare_data
    from labkit.train.presets import get_preset

    data = prepare_data(include=list(get_preset("smoke").include), cache_root=tmp_path / "cache",
                        tokenizer_dir=resolve_model_path("labkit-tiny"))
    out = tmp_path / "student"
    argv = ["distill", "--student", "labkit-tiny-draft", "--data", str(data), "--out",
            str(out), "--max-steps", "2", "--eval-every", "1", "--eval-max-tokens", "256",
            "--batch-size", "2", "--seq-len", "32", "--probe-count", "2", "--probe-tokens", "8",
            "--teacher-text-rows", "2", "--chart", str(tmp_path / "c.html")]
    assert main(argv) == 0
    model, _ = load_pretrained(out)
    log = json.loads((out / "distill_log.json").read_text())
    card = (out / "README.md").read_text()
    assert [e["step"] for e in log["eval"]] == [0, 1, 2] and log["steps"] == 2
    assert f"{log['shipped']['heldout_loss_fp16_weights']:.4f}" in card
    assert f"{log['summary']['probe_alpha']:.3f}" in card and log["command"] in card
    assert 0 <= log["summary"]["probe_alpha"] <= 1
    indep, _ = load_pretrained("labkit-tiny-draft")
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight,
                           indep.model.layers[0].mlp.up_proj.weight)  # it trained
    assert (tmp_path / "c.html").stat().st_size > 1000
