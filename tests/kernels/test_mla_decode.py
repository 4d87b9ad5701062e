"""The absorbed MLA decode kernel (``kernels/mla_decode.py``) under the interpreter: equal to the
PyTorch reference ``labkit.kv.mla.mla_decode_absorbed`` on shuffled paged latents (one and
several head blocks, bf16), named errors for bad input, and a tiny DeepSeek-V3 through the
engine with ``attention_backend="triton"`` decoding through it, greedy equal to the reference."""

import pytest
import torch
from labkit.kernels.backend import TritonBackend
from labkit.kernels.mla_decode import mla_decode_triton
from transformers import DeepseekV3Config

from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.kv.mla import mla_decode_absorbed
from labkit.model.config import ModelConfig
from labkit.model.generate import generate
from labkit.model.llama import LlamaForCausalLM


def case(H: int, seed: int, dtype=torch.float32, lens=(9, 1, 12)):
    g = torch.Generator().manual_seed(seed)
    dn, dr, dv, C, bs, nb = 12, 8, 10, 20, 4, 12
    B = len(lens)
    cache = (torch.randn(nb, bs, 1, C + dr, generator=g) * 2).to(dtype)  # all slots garbage
    bt = torch.stack([torch.randperm(nb, generator=g)[:3] for _ in range(B)]).int()
    ctx = torch.tensor(lens, dtype=torch.int32)
    qn = torch.randn(B, H, dn, generator=g).to(dtype)
    qp = torch.randn(B, H, dr, generator=g).to(dtype)
    w_uk = (torch.randn(H, dn, C, generator=g) * 0.3).to(dtype)
    w_uv = (torch.randn(H, dv, C, generator=g) * 0.3).to(dtype)
    return qn, qp, cache, bt, ctx, w_uk, w_uv, 0.2


@pytest.mark.parametrize("H,dtype,tol", [(5, torch.float32, 1e-5), (70, torch.float32, 1e-5),
                                         (4, torch.bfloat16, 3e-2)])
def test_kernel_equals_reference(H, dtype, tol):
    """H=70: two programs per sequence (64 heads + 6); bf16 runs the dots in bf16 inputs."""
    args = case(H, seed=H, dtype=dtype)
    got = mla_decode_triton(*args).float()
    want = mla_decode_absorbed(*[a.float() if torch.is_tensor(a) and a.is_floating_point()
                                 else a for a in args])
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_bad_input_is_named():
    qn, qp, cache, bt, ctx, w_uk, w_uv, s = case(4, seed=0)
    with pytest.raises(ValueError, match="1, 28"):
        mla_decode_triton(qn, qp, cache[..., :-1], bt, ctx, w_uk, w_uv, s)
    with pytest.raises(ValueError, match="context length"):
        mla_decode_triton(qn, qp, cache, bt, torch.tensor([9, 0, 12], dtype=torch.int32),
                          w_uk, w_uv, s)
    with pytest.raises(ValueError, match="context length"):
        mla_decode_triton(qn, qp, cache, bt, torch.tensor([9, 1, 13], dtype=torch.int32),
                          w_uk, w_uv, s)


def test_engine_decodes_through_the_kernel(monkeypatch):
    calls = [0]
    real = TritonBackend.mla_decode

    def counted(self, *a):
        calls[0] += 1
        return real(self, *a)

    monkeypatch.setattr(TritonBackend, "mla_decode", counted)
    d = DeepseekV3Config(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                         q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                         first_k_dense_replace=2, n_routed_experts=4, n_group=1, topk_group=1,
                         num_experts_per_tok=2, eos_token_id=None).to_dict()
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(
        {**d, "architectures": ["DeepseekV3ForCausalLM"]})).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(5)  # weights of std 0.1: attention far from uniform
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5], [2, 7, 1]]
    llm = LLM.from_model(model, attention_backend="triton", block_size=4, num_blocks=16)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [generate(model, p, 5, ignore_eos=True)
                                                      for p in prompts]
    assert calls[0] >= 2 * 4  # every layer of every decode step (4 steps after the prefill)
