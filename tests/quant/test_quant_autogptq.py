"""labkit's GPTQ checkpoint loaded by AutoGPTQ 0.7.1, the archived original tool.

AutoGPTQ is archived upstream (its successor is GPTQModel, tested in test_quant_interop.py) and
only runs on CPU with transformers 4.51.3 and two monkeypatches, so it lives in an isolated
environment: `bash tests/quant/run_autogptq.sh` builds one and runs this file. In the main
environment this test skips, naming the missing package.

Both sides run in float32 from the same packed integers, so the logits must agree to float32
rounding (atol/rtol 1e-4; measured: identical). A wrong nibble order or zero offset moves logits
as much as quantization itself does, and the test also checks quantization did change them.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(importlib.util.find_spec("auto_gptq") is None,
                       reason="auto_gptq is not installed (archived optional interop package; "
                              "run tests/quant/run_autogptq.sh)"),
]


@pytest.mark.parametrize("act_order", [False, True])
def test_autogptq_loads_labkit_gptq_checkpoint(tmp_path, monkeypatch, act_order):
    import auto_gptq.modeling._base as base

    # AutoGPTQ hard-codes cuda:0 and calls torch.cuda.synchronize while loading
    monkeypatch.setattr(base, "CUDA_0", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    from auto_gptq import AutoGPTQForCausalLM

    from labkit.model.loader import load_pretrained, resolve_model_path
    from labkit.quant import gptq_quantize_model, save_quantized
    from labkit.quant.calib import corpus_windows

    model, tok = load_pretrained("labkit-tiny")
    calib = corpus_windows(tok, "train", 16, 128, seed=0)
    q, _ = gptq_quantize_model(model, calib, group_size=64, act_order=act_order)
    ckpt = save_quantized(q, tmp_path / "tiny-gptq",
                          tokenizer_dir=resolve_model_path("labkit-tiny"))
    theirs_model = AutoGPTQForCausalLM.from_quantized(
        str(ckpt), device="cpu", use_triton=False, disable_exllama=True,
        disable_exllamav2=True, use_safetensors=True, torch_dtype=torch.float32)
    tokens = torch.tensor([tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n"
                                      "    return fibonacci(n - 1) + fibonacci(n - 2)\n")])
    from labkit.quant.linear import use_cpu_packed

    # the exact dequantize-then-matmul path: the packed CPU kernels round activations to bf16
    with torch.no_grad(), use_cpu_packed(False):
        theirs = theirs_model(input_ids=tokens).logits.float()
        ours, fp = q(tokens), model(tokens)
    torch.testing.assert_close(theirs, ours, atol=1e-4, rtol=1e-4)
    assert (fp - ours).abs().max() > 0.1  # quantization really changed the model
