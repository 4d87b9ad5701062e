"""Export to GGUF and load back: labkit-tiny and tiny random Hugging Face checkpoints.

References: the source model's own logits (exact at f32), the ``gguf`` package's quantize +
dequantize applied to the source weights (exact for q8_0/q4_0, an independent path to the same
numbers), transformers' logits for the HF checkpoints, and the original tokenizer.json.

Stated tolerances on labkit-tiny (8 x 128 held-out tokens), relative perplexity change vs the
float16 source: q8_0 within 0.5 %, q4_k_m within 2 %, q4_0 within 8 % (measured: -0.04 %, +0.7 %,
+4.9 %), and q4_k_m better than q4_0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import labkit
from labkit.model.gguf_loader import GGUFError, rope_permute, rope_unpermute
from labkit.model.loader import load_model, load_pretrained
from labkit.quant.gguf_export import export_gguf

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

PPL_TOLERANCE = {"q8_0": 0.005, "q4_k_m": 0.02, "q4_0": 0.08}


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    files = {}
    for t in ("f32", "f16", "q8_0", "q4_0", "q4_k_m"):
        files[t] = d / f"tiny-{t}.gguf"
        export_gguf("labkit-tiny", files[t], type=t, progress=False)
    return files


@pytest.fixture(scope="module")
def tiny():
    return load_pretrained("labkit-tiny")


def _ids(tok):
    return torch.tensor([tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")])


def test_f32_and_f16_round_trip_is_exact(tiny, tiny_files):
    model, tok = tiny
    ids = _ids(tok)
    with torch.no_grad():
        ref = model(ids)
        for t in ("f32", "f16"):  # labkit-tiny's weights are float16, so f16 loses nothing
            m2, tok2 = labkit.load_pretrained(str(tiny_files[t]))
            assert torch.equal(m2(ids), ref), t
    texts = ["def f(x):\n\treturn x  # ok", "héllo wörld 🚀", "<|endoftext|>a  b", ""]
    for s in texts:
        assert tok2.encode(s) == tok.encode(s)
        assert tok2.decode(tok2.encode(s)) == tok.decode(tok.encode(s))


def test_header_declares_what_llama_cpp_needs(tiny_files):
    r = gguf.GGUFReader(tiny_files["q4_k_m"])
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("tokenizer.ggml.t")
         and k != "tokenizer.ggml.merges"}
    assert f["general.architecture"] == "llama" and f["general.file_type"] == 15
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert f["tokenizer.ggml.bos_token_id"] == 0 and f["tokenizer.ggml.add_bos_token"] is True
    assert f["llama.attention.head_count_kv"] == 2 and f["llama.rope.dimension_count"] == 32
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert "output.weight" not in types  # tied: llama.cpp reuses token_embd
    assert types["token_embd.weight"] == "Q6_K" and types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.5.ffn_down.weight"] == "Q8_0" and types["blk.0.ffn_down.weight"] == "Q5_0"
    assert types["output_norm.weight"] == "F32"


@pytest.mark.parametrize("ftype,qtype", [("q8_0", "Q8_0"), ("q4_0", "Q4_0")])
def test_quantized_weights_equal_gguf_reference_path(tiny, tiny_files, ftype, qtype):
    """labkit bytes -> labkit loader == source weights -> gguf quantize -> gguf dequantize."""
    model, tok = tiny
    m2, _ = load_pretrained(tiny_files[ftype])
    T = gguf.GGMLQuantizationType[qtype]
    w = model.model.layers[1].mlp.up_proj.weight.detach().float().numpy()
    ref = gguf.quants.dequantize(gguf.quants.quantize(w, T), T)
    np.testing.assert_array_equal(m2.model.layers[1].mlp.up_proj.weight.numpy(), ref)
    wq = model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # permuted on disk
    refq = gguf.quants.dequantize(gguf.quants.quantize(rope_permute(wq, 8), T), T)
    np.testing.assert_array_equal(m2.model.layers[1].self_attn.q_proj.weight.numpy(),
                                  rope_unpermute(refq, 8))


@pytest.mark.slow
def test_perplexity_within_stated_tolerances(tiny, tiny_files):
    from labkit.quant.calib import corpus_windows
    from labkit.quant.evaluate import log_probs, perplexity_from_logprobs

    model, tok = tiny
    ev = corpus_windows(tok, "heldout", 8, 128)
    base = perplexity_from_logprobs(log_probs(model, ev), ev)
    rel = {}
    for t, tol in PPL_TOLERANCE.items():
        m2, _ = load_pretrained(tiny_files[t])
        rel[t] = perplexity_from_logprobs(log_probs(m2, ev), ev) / base - 1
        assert abs(rel[t]) < tol, (t, rel[t])
    assert rel["q4_k_m"] < rel["q4_0"]  # the k-quant mix beats plain Q4_0 at similar size


def test_rope_permutation_by_hand():
    # one head of dim 4: HF rows (a0, a1 | b0, b1) rotate pairs (a0,b0), (a1,b1);
    # llama.cpp wants each rotating pair adjacent: (a0, b0, a1, b1)
    w = np.array([[1.0], [2.0], [10.0], [20.0]], np.float32)
    np.testing.assert_array_equal(rope_permute(w, 1)[:, 0], [1, 10, 2, 20])
    x = np.random.default_rng(0).standard_normal((4 * 6, 5)).astype(np.float32)
    np.testing.assert_array_equal(rope_unpermute(rope_permute(x, 4), 4), x)
    assert not np.array_equal(rope_permute(x, 4), x)


HF_CASES = {
    "llama-gqa2-tied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                            tie_word_embeddings=True, rope_theta=500000.0)),
    "llama-hd24-bias": ("LlamaConfig", dict(num_attention_heads=8, num_key_value_heads=2,
                                            head_dim=24, attention_bias=True)),
    "qwen2-bias": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                       tie_word_embeddings=True)),
}


def _hf_checkpoint(tmp_path, name):
    cls_name, kw = HF_CASES[name]
    cfg = getattr(transformers, cls_name)(vocab_size=97, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, max_position_embeddings=128,
                                          rms_norm_eps=1e-5, **kw)
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(tmp_path / name)
    return hf, tmp_path / name


@pytest.mark.parametrize("name", list(HF_CASES))
def test_hf_checkpoints_round_trip(tmp_path, name):
    hf, path = _hf_checkpoint(tmp_path, name)
    ours = load_model(path)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref, hf_ref = ours(ids), hf(ids).logits
        for t in ("f32", "f16", "q8_0", "q4_k_m"):
            f = tmp_path / f"{name}-{t}.gguf"
            export_gguf(ours, f, type=t, progress=False)
            m2, tok = load_pretrained(f)
            assert tok is None  # these checkpoints have no tokenizer.json
            assert m2.config.architecture == ours.config.architecture
            got = m2(ids)
            if t == "f32":
                assert torch.equal(got, ref)
                torch.testing.assert_close(got, hf_ref, atol=1e-4, rtol=1e-4)
            else:  # random weights: error scales with the format's precision
                tol = {"f16": 1e-3, "q8_0": 0.02, "q4_k_m": 0.3}[t]
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                assert err < tol, (t, err)


def test_bad_inputs_raise_named_errors(tmp_path, tiny):
    with pytest.raises(GGUFError, match="type must be one of"):
        export_gguf("labkit-tiny", tmp_path / "x.gguf", type="q3_k")
    with pytest.raises(GGUFError, match="no GGUF file"):
        load_pretrained(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        load_pretrained(bad)
    model, _ = tiny
    windowed = load_model("labkit-tiny")
    windowed.config.sliding_window = 8
    with pytest.raises(GGUFError, match="sliding window"):
        export_gguf(windowed, tmp_path / "w.gguf", type="f32")
    n = windowed.config.num_hidden_layers  # some layers only: named as per-layer windows
    windowed.config.layer_types = ["sliding_attention"] + ["full_attention"] * (n - 1)
    with pytest.raises(GGUFError, match=r"per-layer sliding windows \(layers \[0\] slide\)"):
        export_gguf(windowed, tmp_path / "w.gguf", type="f32")


def test_q4_0_kept_quantized_as_gptq_groups_is_exact(tiny, tiny_files):
    from labkit.quant.gguf_linear import load_gguf_keep_q4_0
    from labkit.quant.linear import GPTQLinear

    model, tok = tiny
    kept, _ = load_gguf_keep_q4_0(tiny_files["q4_0"])
    dense, _ = load_pretrained(tiny_files["q4_0"])
    layer = kept.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, GPTQLinear) and layer.mlp.up_proj.group_size == 32
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj"):
        torch.testing.assert_close(layer.get_submodule(name).dequantize(),
                                   dense.model.layers[0].get_submodule(name).weight,
                                   rtol=0, atol=0)
    from labkit.quant.linear import use_cpu_packed

    ids = _ids(tok)
    with torch.no_grad():
        ref = dense(ids)
        with use_cpu_packed(False):  # dequantize-then-matmul: the same float32 numbers
            torch.testing.assert_close(kept(ids), ref, rtol=1e-5, atol=1e-5)
        # the packed INT4 CPU kernel (bf16 activations) reads the Q4_0 codes directly
        assert (kept(ids) - ref).abs().max() < 0.02 * ref.abs().max()
