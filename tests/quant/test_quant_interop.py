"""labkit's GPTQ/AWQ checkpoints in the real tools, and the real tools' results next to labkit's.

Run in an environment with the optional packages (see README "Quantization interop"):
  GPTQMODEL_CPU_WORKERS=2 python -m pytest tests/quant -m interop
Verified with torch 2.13.0 (CPU), transformers 5.24.0, gptqmodel 7.6.0, optimum 2.3.0,
autoawq 0.2.9. Each test skips, saying which, only when its package is not installed.

Tolerance for logits (labkit vs transformers+gptqmodel): transformers runs the checkpoint in
float16 (its config dtype) while labkit computes in float32 from the same packed integers, so the
two differ by float16 rounding only: we require max |Δlogit| <= 2% of max |logit|, >= 97% equal
argmax, and the difference to be under a tenth of what quantization itself changed (so a wrong
nibble order or zero offset, which moves logits as much as quantization does, cannot pass).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from labkit.quant import (
    awq_quantize_model,
    gptq_quantize_model,
    load_quantized,
    quantize_model,
    save_quantized,
)
from labkit.quant.evaluate import log_probs, perplexity_from_logprobs

pytestmark = pytest.mark.interop
os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
GROUP = 64  # labkit-tiny's FFN width 704 is a multiple of 64, not of 128


def _need(pkg: str):
    return pytest.mark.skipif(importlib.util.find_spec(pkg) is None,
                              reason=f"{pkg} is not installed (optional interop package)")


@pytest.fixture(scope="module")
def tiny_lm():
    from labkit.model.loader import load_pretrained, resolve_model_path
    from labkit.quant.calib import corpus_windows

    model, tok = load_pretrained("labkit-tiny")
    calib = corpus_windows(tok, "train", 16, 128, seed=0)
    evalt = corpus_windows(tok, "heldout", 8, 128)
    return model, resolve_model_path("labkit-tiny"), calib, evalt


def _compare_with_transformers(ckpt, labkit_model, fp_model, tokens):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), device_map="cpu")
    with torch.no_grad():
        theirs = hf(tokens).logits.float()
        ours = labkit_model(tokens)
        fp = fp_model(tokens)
    diff = (theirs - ours).abs().max()
    assert diff <= 0.02 * ours.abs().max()
    assert (theirs.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.97
    assert diff < 0.1 * (fp - ours).abs().max()
    return hf


@_need("gptqmodel")
@pytest.mark.parametrize("act_order", [False, True])
def test_labkit_gptq_checkpoint_loads_in_transformers_gptqmodel(tiny_lm, tmp_path, act_order):
    model, src, calib, evalt = tiny_lm
    q, _ = gptq_quantize_model(model, calib, group_size=GROUP, act_order=act_order,
                               progress=False)
    save_quantized(q, tmp_path, tokenizer_dir=src)
    hf = _compare_with_transformers(tmp_path, load_quantized(tmp_path), model, evalt[:2])
    assert "QuantLinear" in type(hf.model.layers[0].mlp.down_proj).__name__ or \
        "Linear" in type(hf.model.layers[0].mlp.down_proj).__name__
    assert not isinstance(hf.model.layers[0].mlp.down_proj, torch.nn.Linear)


@_need("gptqmodel")
def test_labkit_awq_checkpoint_loads_in_transformers_gptqmodel(tiny_lm, tmp_path):
    model, src, calib, evalt = tiny_lm
    q, _ = awq_quantize_model(model, calib, group_size=GROUP, n_grid=10, progress=False)
    save_quantized(q, tmp_path, tokenizer_dir=src)
    hf = _compare_with_transformers(tmp_path, load_quantized(tmp_path), model, evalt[:2])
    assert not isinstance(hf.model.layers[0].mlp.down_proj, torch.nn.Linear)


def _ppl(model, tokens):
    return perplexity_from_logprobs(log_probs(model, tokens), tokens)


@_need("gptqmodel")
def test_gptqmodel_quantizer_side_by_side(tiny_lm, tmp_path, record_property):
    """gptqmodel quantizes the same model on the same calibration tokens; labkit loads its
    checkpoint, and labkit's own GPTQ must be about as good (within 3% perplexity)."""
    from gptqmodel import GPTQModel, QuantizeConfig

    model, src, calib, evalt = tiny_lm
    cfg = QuantizeConfig(bits=4, group_size=GROUP, desc_act=True, sym=False, damp_percent=0.01)
    gm = GPTQModel.load(str(src), cfg, device="cpu")
    gm.quantize([{"input_ids": r.tolist(), "attention_mask": [1] * len(r)} for r in calib],
                batch_size=4)
    gm.save(str(tmp_path))
    theirs = _ppl(load_quantized(tmp_path), evalt)
    ours = _ppl(gptq_quantize_model(model, calib, group_size=GROUP, act_order=True,
                                    progress=False)[0], evalt)
    rtn = _ppl(quantize_model(model, "int4_rtn", group_size=GROUP), evalt)
    print(f"perplexity fp32 {_ppl(model, evalt):.4f} rtn {rtn:.4f} labkit-gptq {ours:.4f} "
          f"gptqmodel {theirs:.4f}")
    record_property("ppl", {"rtn": rtn, "labkit": ours, "gptqmodel": theirs})
    assert ours <= 1.03 * theirs
    assert theirs < rtn and ours < rtn


@_need("awq")
def test_autoawq_quantizer_side_by_side(tiny_lm, tmp_path, record_property):
    """autoawq (archived upstream; successor: llm-compressor / gptqmodel) on the same model and
    tokens; labkit loads its GEMM checkpoint; labkit's AWQ within 3% perplexity of it."""
    import awq.modules.linear.gemm as gemm
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    gemm.TRITON_AVAILABLE = False  # its forward otherwise needs CUDA Triton kernels
    model, src, calib, evalt = tiny_lm
    am = AutoAWQForCausalLM.from_pretrained(str(src), device_map="cpu", dtype=torch.float32)
    am.quantize(AutoTokenizer.from_pretrained(str(src)),
                quant_config={"zero_point": True, "q_group_size": GROUP, "w_bit": 4,
                              "version": "GEMM"},
                calib_data=[r.tolist() for r in calib], max_calib_samples=len(calib),
                max_calib_seq_len=calib.shape[1])
    am.save_quantized(str(tmp_path))
    theirs = _ppl(load_quantized(tmp_path), evalt)
    ours = _ppl(awq_quantize_model(model, calib, group_size=GROUP, progress=False)[0], evalt)
    rtn = _ppl(quantize_model(model, "int4_rtn", group_size=GROUP), evalt)
    print(f"perplexity fp32 {_ppl(model, evalt):.4f} rtn {rtn:.4f} labkit-awq {ours:.4f} "
          f"autoawq {theirs:.4f}")
    record_property("ppl", {"rtn": rtn, "labkit": ours, "autoawq": theirs})
    assert ours <= 1.03 * theirs
