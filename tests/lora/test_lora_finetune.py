"""LoRA / QLoRA fine-tuning (labkit.train.lora_finetune) and merging (labkit.lora.merge,
``labkit lora merge``), on tiny random checkpoints, against transformers + peft."""

from __future__ import annotations

import pytest
import torch

from labkit.lora.merge import dequantize_model, merge_lora
from labkit.lora.writer import save_peft_adapter
from labkit.model.loader import load_model
from labkit.quant.linear import NF4Linear
from labkit.quant.model import quantize_model
from labkit.train.lora_finetune import (
    LoRATrainConfig,
    adapter_weights,
    finetune_lora,
    load_adapter_layers,
    prepare_base,
)
from tests.lora.conftest import peft, peft_greedy, save_adapter, transformers

TARGETS = ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _stream(n: int = 4000, period: int = 11, vocab: int = 97) -> torch.Tensor:
    """A periodic id stream: a random model predicts it badly, a small adapter learns it."""
    return (torch.arange(n) * 7 % period * 5 + 3) % vocab


def _cfg(**kw) -> LoRATrainConfig:
    base = dict(r=4, alpha=8, target_modules=TARGETS, steps=30, lr=1e-2, batch_size=4,
                seq_len=32, warmup_steps=2, eval_every=30, eval_max_tokens=256, log_every=5)
    return LoRATrainConfig(**{**base, **kw})


def _logits(model, x):
    with torch.no_grad():
        out = model(x)
    return (out.logits if hasattr(out, "logits") else out).float()


def test_finetune_lowers_loss_and_peft_loads_it(tmp_path, llama_dir):
    model = load_model(llama_dir, dtype=torch.float32, device="cpu")
    ids = _stream()
    layers, log = finetune_lora(model, _cfg(), ids, ids[:600], progress=False)
    assert log["train"][-1]["loss"] < log["train"][0]["loss"] - 0.5
    assert log["eval"][-1]["heldout_loss"] < log["eval"][0]["heldout_loss"] - 0.5
    assert all(float(m.lora_B.detach().abs().max()) > 0 for m in layers.values())  # trained
    out = save_peft_adapter(tmp_path / "ad", adapter_weights(layers), 4, 8, base_model=llama_dir)

    ref = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(llama_dir), str(out)).eval()
    x = ids[:40][None]
    torch.testing.assert_close(_logits(model, x), _logits(ref, x), atol=1e-4, rtol=1e-4)

    from labkit import LLM, LoRARequest, SamplingParams

    llm = LLM(model=str(llama_dir), dtype=torch.float32, device="cpu", enable_lora=True,
              max_loras=1, max_lora_rank=8)
    prompt = ids[:12].tolist()
    got = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True),
        lora_request=LoRARequest("ft", 1, str(out)), use_tqdm=False)[0].outputs[0].token_ids
    assert list(got) == peft_greedy(llama_dir, out, prompt, 10)


def test_qlora_trains_adapter_and_leaves_nf4_codes_bit_identical(llama_dir):
    cfg = _cfg(qlora=True, steps=20)
    model = prepare_base(load_model(llama_dir, dtype=torch.float32, device="cpu"), cfg)
    nf4 = {n: m for n, m in model.named_modules() if isinstance(m, NF4Linear)}
    assert len(nf4) == 2 * 7  # every decoder linear of the 2 layers
    before = {n: (m.packed.clone(), m.absmax.clone()) for n, m in nf4.items()}
    ids = _stream()
    layers, log = finetune_lora(model, cfg, ids, ids[:600], progress=False)
    assert log["train"][-1]["loss"] < log["train"][0]["loss"] - 0.5
    for n, m in nf4.items():
        assert torch.equal(m.packed, before[n][0]) and torch.equal(m.absmax, before[n][1]), n
    assert all(not p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    assert isinstance(layers["model.layers.0.self_attn.q_proj"].base_layer, NF4Linear)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory, llama_dir):
    return save_adapter(llama_dir, tmp_path_factory.mktemp("merge") / "ad", TARGETS, r=8,
                        alpha=16, seed=5, b_std=0.3)


def test_lora_merge_cli_fp_equals_peft_unmerged(tmp_path, llama_dir, adapter):
    from labkit.cli import main

    assert main(["lora", "merge", "--base", str(llama_dir), "--adapter", str(adapter),
                 "--out", str(tmp_path / "merged")]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    ref = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(llama_dir), str(adapter)).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir).eval()
    x = _stream()[:48][None]
    torch.testing.assert_close(_logits(merged, x), _logits(ref, x), atol=1e-4, rtol=1e-4)
    assert (_logits(base, x) - _logits(ref, x)).abs().max() > 1e-2  # the adapter matters


def test_naive_nf4_requantize_is_not_the_trained_model(llama_dir, adapter):
    """(a) NF4 base + adapter unmerged; merged into the de-quantized NF4 base it is the same
    function, but re-quantized to NF4 it is not (the QLoRA deployment pitfall)."""
    base = load_model(llama_dir, dtype=torch.float32, device="cpu")
    nf4 = quantize_model(base, "nf4", blocksize=64)
    a = quantize_model(base, "nf4", blocksize=64)
    load_adapter_layers(a, str(adapter))
    c = merge_lora(dequantize_model(nf4), str(adapter), "fp")
    b = merge_lora(nf4, str(adapter), "nf4")
    x = _stream()[:48][None]
    la, lb, lc = _logits(a, x), _logits(b, x), _logits(c, x)
    torch.testing.assert_close(lc, la, atol=1e-4, rtol=1e-4)
    assert (lb - la).abs().max() > 100 * (lc - la).abs().max().clamp(min=1e-6)
    assert isinstance(b.get_submodule("model.layers.0.self_attn.q_proj"), NF4Linear)
    with pytest.raises(ValueError, match="re-quantizes NF4 layers"):
        merge_lora(base, str(adapter), "nf4")


def test_finetune_without_lora_is_refused(capsys):
    from labkit.cli import main

    with pytest.raises(SystemExit) as e:
        main(["finetune", "--style", "tests", "--out", "/nonexistent"])
    assert e.value.code == 2 and "--lora" in capsys.readouterr().err


def test_gptq_merge_keeps_the_adapter_and_round_trips(tmp_path, llama_dir, adapter):
    """(c): merged into the de-quantized NF4 base, GPTQ 4-bit, saved and loaded back: the
    served model is the merged one up to quantization, far closer to it than the base is."""
    from labkit.lora.cli import gptq, merged_model
    from labkit.quant.checkpoint import load_quantized, save_quantized

    fp = merged_model(llama_dir, adapter, nf4_base=True, blocksize=64)
    calib = torch.randint(0, 97, (8, 32), generator=torch.Generator().manual_seed(0))
    q = gptq(merged_model(llama_dir, adapter, nf4_base=True, blocksize=64), calib, group_size=16,
             sym=True)
    back = load_quantized(save_quantized(q, tmp_path / "gptq", dtype=torch.float32))
    base = load_model(llama_dir, dtype=torch.float32, device="cpu")
    x = _stream()[:48][None]
    lq, lf = _logits(back, x), _logits(fp, x)
    torch.testing.assert_close(lq, _logits(q, x), atol=1e-4, rtol=1e-4)
    assert (lq - lf).abs().mean() < 0.25 * (_logits(base, x) - lf).abs().mean()
