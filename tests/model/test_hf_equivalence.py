"""labkit's model equals transformers' on tiny random checkpoints saved with save_pretrained."""

import json

import pytest
import torch

from labkit.model import CheckpointError, ConfigError, generate, load_pretrained
from labkit.model.loader import load_model

transformers = pytest.importorskip("transformers")

CASES = {
    # name: (config class, kwargs)
    "llama-gqa1": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa2-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=True, rope_theta=500000.0)),
    "llama-gqa4-bias-hd": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2,
                                               attention_bias=True, head_dim=24)),
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                  rope_theta=1000000.0, tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=1,
                                      sliding_window=None)),
    # a window shorter than the test prompts, so the sliding-window mask is exercised
    "mistral-window8": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                              sliding_window=8)),
}


def make_checkpoint(tmp_path, name, seed=0):
    cls_name, kw = CASES[name]
    base = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                max_position_embeddings=128, rms_norm_eps=1e-5)
    cfg = getattr(transformers, cls_name)(**base, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    # random init leaves norms at 1 and biases at 0: perturb them so the test sees them
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / name
    model.save_pretrained(path)
    return model, path


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(tmp_path, name):
    hf, path = make_checkpoint(tmp_path, name)
    ours = load_model(path)
    for T in (1, 7, 33):
        ids = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            ref = hf(ids).logits
            got = ours(ids)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa2-tied", "qwen2", "mistral-window8"])
def test_greedy_generation_matches_transformers(tmp_path, name):
    hf, path = make_checkpoint(tmp_path, name, seed=1)
    ours = load_model(path)
    prompt = [5, 17, 42, 8, 3]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 20, ignore_eos=True) == ref


def test_sharded_checkpoint(tmp_path):
    hf, path = make_checkpoint(tmp_path, "llama-gqa1")
    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    ids = torch.tensor([[1, 2, 3, 4]])
    torch.testing.assert_close(load_model(sharded)(ids), load_model(path)(ids))


def test_bad_checkpoints(tmp_path):
    _, path = make_checkpoint(tmp_path, "llama-gqa1")
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="no model folder"):
        load_model(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="Hub id"):
        load_model("meta-llama/Llama-2-7b-hf")
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(path)
    (path / "config.json").write_text(json.dumps({**cfg, "hidden_size": 32}))
    with pytest.raises(CheckpointError, match="has shape"):
        load_model(path)
    (path / "config.json").write_text(json.dumps(
        {**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ConfigError, match="rope_scaling"):
        load_model(path)
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"],
                                                  "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="architectures"):
        load_model(path)
    (path / "config.json").write_text(json.dumps(cfg))
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors"):
        load_model(path)
    with pytest.raises(CheckpointError, match="tokenizer|no tokenizer|neither"):
        load_pretrained(path)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_load_in_low_precision(tmp_path, dtype):
    hf, path = make_checkpoint(tmp_path, "llama-gqa2-tied")
    low = load_model(path, dtype=dtype)
    assert low.dtype == getattr(torch, dtype)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.no_grad():
        ref = hf(ids).logits
    assert (low(ids).float() - ref).abs().max() < 0.05
    with pytest.raises(ValueError, match="dtype"):
        load_model(path, dtype="int8")
