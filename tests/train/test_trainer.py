"""Trainer: schedule, batches, evaluation against a plain loop, loss goes down, resume is exact."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.train.data import load_token_data, prepare_data
from labkit.train.trainer import TrainConfig, evaluate, lr_at, sample_batch, train

VOCAB = 300


def _model_config() -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                       max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0,
                       eos_token_id=0)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    path = prepare_data(include=["json/", "sched.py"], vocab_size=VOCAB, cache_root=cache,
                        max_length=64)
    assert prepare_data(include=["json/", "sched.py"], vocab_size=VOCAB,
                        cache_root=cache) == path  # second call hits the cache
    return load_token_data(path)


def _cfg(**kw) -> TrainConfig:
    base = dict(seq_len=32, batch_size=8, max_steps=6, lr=3e-3, warmup_steps=2, eval_every=3,
                eval_max_tokens=600, log_every=1, checkpoint_every=100)
    return TrainConfig(**{**base, **kw})


def test_prepared_streams_are_eot_separated_documents(data):
    meta = data.meta
    assert meta["heldout_names"] == ["sched.py"]
    assert data.train[0] == 0 and data.train[-1] == 0 and data.heldout[0] == 0
    # one EOT opens each document, plus the closing one
    assert int((data.train == 0).sum()) == meta["train_documents"] + 1
    assert int(data.train.max()) < VOCAB


def test_lr_schedule_hand_computed():
    cfg = _cfg(lr=1.0, warmup_steps=10, min_lr_ratio=0.1, max_steps=110)
    assert lr_at(0, cfg, 110) == pytest.approx(0.1)
    assert lr_at(9, cfg, 110) == pytest.approx(1.0)
    assert lr_at(10, cfg, 110) == pytest.approx(1.0)
    assert lr_at(60, cfg, 110) == pytest.approx(0.1 + 0.9 * 0.5)  # half-way: cos(pi/2) = 0
    assert lr_at(110, cfg, 110) == pytest.approx(0.1)


def test_batches_are_shifted_windows_of_the_stream():
    data = torch.arange(1000)
    x, y = sample_batch(data, _cfg(seq_len=16, batch_size=4), torch.Generator().manual_seed(1))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(x[:, 1:] - x[:, :-1], torch.ones(4, 15, dtype=torch.long))


def test_evaluate_equals_a_plain_loop():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_model_config()).eval()
    stream = torch.randint(0, VOCAB, (203,))
    got = evaluate(model, stream, seq_len=32, batch_size=3)
    nll, n = 0.0, 0
    for s in range(0, 202, 32):  # windows of 32 predictions, the last one of 10
        w = stream[s:min(s + 33, 203)]
        with torch.no_grad():
            logits = model(w[None, :-1])[0]
        nll += F.cross_entropy(logits, w[1:], reduction="sum").item()
        n += len(w) - 1
    assert n == 202
    assert got == pytest.approx(nll / n, rel=1e-5)


def test_training_lowers_heldout_loss(data, tmp_path):
    cfg = _cfg(max_steps=25, eval_every=25, lr=1e-2, warmup_steps=5)
    model, log = train(_model_config(), cfg, data.train, data.heldout, tmp_path / "ck.pt")
    first, last = log["eval"][0]["heldout_loss"], log["eval"][-1]["heldout_loss"]
    assert first == pytest.approx(math.log(VOCAB), abs=0.3)  # untrained: near uniform
    assert last < first - 1.0
    assert log["train"][-1]["loss"] < log["train"][0]["loss"] - 1.0
    assert log["finished"] and log["tokens_seen"] == 25 * 8 * 32


def test_resume_equals_uninterrupted(data, tmp_path):
    mc = _model_config()
    full, log_full = train(mc, _cfg(), data.train, data.heldout, tmp_path / "a.pt")
    part, log_part = train(mc, _cfg(stop_after=3), data.train, data.heldout, tmp_path / "b.pt")
    assert log_part["steps"] == 3 and not log_part["finished"]
    resumed, log_res = train(mc, _cfg(), data.train, data.heldout, tmp_path / "b.pt",
                             resume=True)
    assert log_res["resumed_at"] == [3] and log_res["steps"] == 6
    for (k, a), (_, b) in zip(full.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), k
    assert [e["heldout_loss"] for e in log_res["eval"]] == \
        [e["heldout_loss"] for e in log_full["eval"]]


def test_time_budget_resolves_max_steps(data, tmp_path):
    cfg = _cfg(max_steps=None, time_budget_s=1.0, max_epochs=0.05, warmup_steps=20)
    _, log = train(_model_config(), cfg, data.train, data.heldout, tmp_path / "c.pt")
    cap = int(0.05 * data.train.numel() / (8 * 32))
    r = log["resolved_max_steps"]
    assert r["at_step"] == 3 + 10 and log["steps"] == r["max_steps"] <= max(cap, 14)


def test_bad_settings_are_named_errors(data, tmp_path):
    with pytest.raises(ValueError, match="max_steps or time_budget_s"):
        TrainConfig()
    with pytest.raises(ValueError, match="batch_size"):
        _cfg(batch_size=0)
    with pytest.raises(ValueError, match="context"):
        train(_model_config(), _cfg(seq_len=128), data.train, data.heldout, tmp_path / "d.pt")
    small = ModelConfig(**{**_model_config().__dict__, "vocab_size": 100, "extra": {}})
    with pytest.raises(ValueError, match="vocab_size"):
        train(small, _cfg(), data.train, data.heldout, tmp_path / "e.pt")
    with pytest.raises(ValueError, match="prepared-data"):
        load_token_data(tmp_path)
