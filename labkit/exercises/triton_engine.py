"""Your paged-attention kernel serves the engine's decode steps.

labkit's engine calls an attention backend (``labkit.kv.attention``): ``reshape_and_cache`` to
write new K/V into their slots, ``prefill`` for prompt chunks and ``decode`` for one new token per
sequence. This backend answers ``decode`` with your one-head kernel, launched once per query head
on that head's KV head (grouped-query attention: query head h reads KV head h // group), and
leaves the rest to the torch reference. Greedy generation through ``LLMEngine`` must then equal
the reference ``generate`` token for token.
"""

from __future__ import annotations

from typing import Any

import torch

from labkit.config import EngineConfig
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.model_runner import ModelExecutor, ModelRunner
from labkit.engine.sampling_params import SamplingParams
from labkit.exercises import triton_kernels
from labkit.exercises.checks import CheckFailure, run_check
from labkit.kv.attention import TorchBackend
from labkit.model.generate import generate
from labkit.model.testing import tiny_model


class LearnerDecodeBackend:
    """An AttentionBackend whose decode runs the learner's kernel head by head."""

    name = "learner"

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.reference = TorchBackend()
        self.launches = 0

    def reshape_and_cache(self, *args: Any, **kw: Any) -> None:
        self.reference.reshape_and_cache(*args, **kw)

    def prefill(self, *args: Any, **kw: Any) -> torch.Tensor:
        return self.reference.prefill(*args, **kw)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
               **kw: Any) -> torch.Tensor:
        if kw.get("sliding_window") is not None:
            return self.reference.decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                         **kw)
        num_seqs, hq, d = q.shape
        num_blocks, block_size, hkv, _ = k_cache.shape
        tables = block_tables.to(torch.int32).contiguous()
        lens = context_lens.to(torch.int32).contiguous()
        out = torch.empty(num_seqs, hq, d, dtype=torch.float32, device=q.device)
        for h in range(hq):
            kv = h // (hq // hkv)
            kc = k_cache[:, :, kv, :].float().contiguous()
            vc = v_cache[:, :, kv, :].float().contiguous()
            o = torch.empty(num_seqs, d, dtype=torch.float32, device=q.device)
            self.kernel[(num_seqs,)](q[:, h, :].float().contiguous(), kc, vc, tables, lens, o,
                                     scale, tables.shape[1], BLOCK_SIZE=block_size, HEAD_DIM=d)
            self.launches += 1
            out[:, h, :] = o
        return out.to(q.dtype)


def check_on_engine(paged_attention_kernel: Any, model: torch.nn.Module | None = None,
                    *, max_tokens: int = 6) -> object:
    """Greedy generation through LLMEngine with your kernel doing every decode step."""

    def body() -> str:
        m = model if model is not None else tiny_model()
        m = m.to(triton_kernels.device())
        block_size = 4
        backend = LearnerDecodeBackend(paged_attention_kernel)
        ex = ModelExecutor(ModelRunner.for_model(m, block_size, 64, 0, backend))
        c = m.config
        config = EngineConfig.from_kwargs(num_blocks=64, block_size=block_size,
                                          max_model_len=c.max_position_embeddings,
                                          vocab_size=c.vocab_size, max_num_seqs=4,
                                          max_num_batched_tokens=64)
        engine = LLMEngine(config, ex)
        g = torch.Generator().manual_seed(2)
        prompts = [torch.randint(0, c.vocab_size, (n,), generator=g).tolist() for n in (5, 11, 7)]
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                          ignore_eos=True))
        outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        try:
            while engine.has_unfinished_requests():
                for o in engine.step():
                    outputs[o.request_id].extend(o.new_token_ids)
        except CheckFailure:
            raise
        except Exception as e:  # noqa: BLE001 - learner kernel failing inside the engine
            raise CheckFailure(f"your kernel failed inside the engine: {type(e).__name__}: {e}",
                               show_values=False,
                               hint="run triton_kernels.check_paged_attention first.") from e
        for i, p in enumerate(prompts):
            want = generate(m, p, max_tokens, ignore_eos=True)
            if outputs[f"r{i}"] != want:
                raise CheckFailure(f"request r{i} generated different tokens with your kernel",
                                   inputs=f"prompt={p}, greedy, max_tokens={max_tokens}",
                                   expected=want, actual=outputs[f"r{i}"],
                                   hint="decode attention disagrees with the reference; the "
                                        "first differing token is the first wrong decode step.")
        return (f"LLMEngine generated {len(prompts)} requests with your kernel doing all "
                f"{backend.launches} decode-attention launches; every token equals reference "
                "generation.")

    return run_check("triton_paged_attention", body, record=False)
