"""Drill bank, part 5: what gets deployed next to the base model — LoRA adapters (many of them,
QLoRA ones), models on phones and NPUs, and a safety check in the serving path. Data only.

As in the other parts, each snippet computes its numbers with labkit (memory calculator,
roofline, NF4 quantizer) and asserts the claim its answer makes.
"""

from __future__ import annotations

from labkit.exercises.drills_core import d

DEPLOY = [
    d("lora-memory", "lora",
      "How much memory does one LoRA adapter for Llama-2-7B take, and how many fit beside one "
      "copy of the base model?",
      "LoRA replaces a frozen weight W [out, in] by W + (alpha/r) x B x A with A [r, in] and B "
      "[out, r], so an adapter costs r x (in + out) parameters per adapted matrix and nothing "
      "else: the base weights and the KV cache layout are shared. Rank 16 on all seven linears of"
      " every layer (q, k, v, o, gate, up, down) of Llama-2-7B is 40.0M parameters, 80 MB in "
      "fp16, 0.6% of the base model's linear weights (and 0.6% more FLOPs per token when applied "
      "unmerged). Rank 8 on the query and value projections only (the two the LoRA paper adapted "
      "in most of its experiments) is 4.2M parameters, 8.4 MB. A hundred rank-16 adapters take 8 "
      "GB beside one 13.5 GB base, where a hundred merged fine-tunes would take 1.35 TB. Adapters"
      " not in use wait in CPU memory; loading one over PCIe (~25 GB/s) takes a few milliseconds."
      " Common wrong answer: 'every fine-tune needs its own replica', which is only true once the"
      " adapter is merged into the weights.",
      """
      from labkit.quant.memory import estimate_memory, get_config, linear_shapes
      cfg = get_config("llama-2-7b")
      shapes = linear_shapes(cfg)  # (out, in, has_bias) of every decoder linear, layer by layer
      per_layer = len(shapes) // cfg.num_hidden_layers  # q, k, v, o, gate, up, down
      def adapter_params(rank, which=range(per_layer)):
          return sum(rank * (o + i) for n, (o, i, _) in enumerate(shapes) if n % per_layer in which)
      all16, qv8 = adapter_params(16), adapter_params(8, which=(0, 2))
      share = all16 / sum(o * i for o, i, _ in shapes)
      base = estimate_memory("llama-2-7b", "fp16").weight_bytes
      print(f"rank 16, all linears: {all16:,} params = {2 * all16 / 1e6:.1f} MB ({share:.2%} "
            f"of the linear weights); rank 8, q+v: {qv8:,} params = {2 * qv8 / 1e6:.1f} MB")
      print(f"100 adapters: {100 * 2 * all16 / 1e9:.1f} GB beside one {base / 1e9:.1f} GB base; "
            f"100 merged copies: {100 * base / 1e12:.2f} TB")
      assert share < 0.01 and 100 * 2 * all16 < base
      """),
    d("lora-batching", "lora",
      "One batch holds requests for five different LoRA adapters of the same base model. How "
      "does a single forward pass serve them all, and why not merge each adapter into the "
      "weights?",
      "Keep the base weights unmerged and shared: x W^T for the whole batch is one large GEMM, "
      "exactly as without LoRA, and then each token adds its own low-rank term (x A_i^T) B_i^T, "
      "with the adapter i picked by an index per token. Punica's SGMV kernel (segmented "
      "gather matrix-vector multiply), and vLLM's LoRA kernels that grew from it, gather the "
      "right A and B for each token or run of tokens, so five adapters cost one base GEMM plus "
      "thin shrink (to rank r) and expand (back to the output size) products: for a 4096 x 4096 "
      "projection at rank 16 that is 0.8% more FLOPs. Merging W + B A costs nothing per token "
      "but serves one adapter per copy of the weights (or swaps weights between steps), which "
      "ends batching across adapters. S-LoRA adds the memory side: all adapters in host memory, "
      "the active ones paged into one GPU pool shared with the KV cache (both are made of "
      "hidden-size vectors), so adapters of different ranks and sequences of different lengths "
      "share pages without fragmenting memory. vLLM exposes the limits as max_loras (adapters "
      "in one batch), max_lora_rank and max_cpu_loras. The cost of staying unmerged is a few "
      "percent of latency and extra kernel launches. Common wrong answer: 'one replica per "
      "adapter'. In labkit: LLM(..., enable_lora=True, max_loras=4) mixes adapters in one "
      "batch (lora/punica.py; Triton SGMV/BGMV in kernels/lora_ops.py), and labkit bench lora "
      "measures the mixed batch against one adapter at a time and the base model.",
      """
      import torch
      g = torch.Generator().manual_seed(0)
      d_in, d_out, rank, adapters = 64, 96, 8, 5
      W = torch.randn(d_out, d_in, generator=g) / d_in**0.5  # shared base weight
      A = torch.randn(adapters, rank, d_in, generator=g) / d_in**0.5
      B = torch.randn(adapters, d_out, rank, generator=g) / rank**0.5
      x = torch.randn(10, d_in, generator=g)  # 10 tokens from requests of different adapters
      idx = torch.tensor([0, 3, 3, 1, 4, 0, 2, 2, 4, 1])
      shrink = torch.einsum("th,trh->tr", x, A[idx])  # gather each token's A
      batched = x @ W.T + torch.einsum("tr,tor->to", shrink, B[idx])
      merged = torch.stack([x[t] @ (W + B[idx[t]] @ A[idx[t]]).T for t in range(len(x))])
      err = (batched - merged).abs().max().item()
      h, r = 4096, 16
      print(f"{adapters} adapters in one batch, max difference from per-request merged "
            f"weights: {err:.1e}; extra FLOPs at rank {r} on a {h}x{h} projection: "
            f"{r * (h + h) / (h * h):.2%}")
      assert err < 1e-5
      """),
    d("qlora-deploy", "lora",
      "A model was fine-tuned with QLoRA (an NF4 base plus a 16-bit adapter). How do you deploy "
      "it, and why is 'merge the adapter into the original fp16 weights' subtly wrong?",
      "During QLoRA training the adapter only ever saw the dequantized NF4 weights W_q, so the "
      "model you trained and evaluated computes x (W_q + s B A)^T. Merging B A into the original "
      "W instead gives a model that differs from it by x (W - W_q)^T, the whole NF4 rounding "
      "error, which the adapter may partly have learned to compensate: a different model from "
      "the one you evaluated. The options: (1) serve unmerged on the NF4 base (bitsandbytes "
      "kernels; vLLM can apply LoRA on a bitsandbytes 4-bit base), exactly the trained model "
      "but with slower 4-bit kernels; (2) dequantize the NF4 base to fp16 and add B A, which "
      "equals the trained model up to rounding, and serve that; (3) quantize that merged model "
      "again with GPTQ or AWQ for fast serving, which adds a new quantization error of its own, "
      "so run the evaluation again. A serving engine cannot take the QLoRA output as a quantized "
      "checkpoint: it is an adapter plus a base stored in a training-time format, not a GPTQ or "
      "AWQ checkpoint. Common wrong answer: 'QLoRA already produced a 4-bit model, so load it "
      "in vLLM as one'.",
      """
      import torch
      from labkit.quant.nf4 import quantize_nf4
      from labkit.quant.rtn import fake_quantize
      g = torch.Generator().manual_seed(0)
      W = torch.randn(128, 256, generator=g) * 0.02  # the original fp16 base weight
      Wq = quantize_nf4(W, blocksize=64).dequantize()  # what QLoRA training saw
      A = torch.randn(16, 256, generator=g) * 0.01
      B = torch.randn(128, 16, generator=g) * 0.01
      x = torch.randn(32, 256, generator=g)
      trained = x @ Wq.T + (x @ A.T) @ B.T
      def error(W_deployed):  # relative to the model that was trained
          return ((x @ W_deployed.T - trained).norm() / trained.norm()).item()
      options = {"merged into dequantized NF4": error(Wq + B @ A),
                 "merged into original fp16": error(W + B @ A),
                 "merged, re-quantized to INT4 g64": error(fake_quantize(Wq + B @ A, 4, 64))}
      for name, e in options.items():
          print(f"{name}: relative output error {e:.2e}")
      assert options["merged into dequantized NF4"] < 1e-5
      assert options["merged into original fp16"] > 0.05
      """),
    d("on-device", "on-device",
      "A phone has 12 GB of LPDDR5X (about 60 GB/s) and an NPU rated at tens of TOPS. How fast "
      "can it decode with a 7B model and with a 1B model, and which quantization do you pick?",
      "Decode reads every weight once per token, so tokens/s <= memory bandwidth / bytes read "
      "per token; the NPU's TOPS speed up prefill (prompt processing, compute-bound), not "
      "decode. Llama-2-7B in fp16 (13.5 GB) does not fit at all. In 4-bit with group scales it "
      "is 3.9 GB and reads about 3.6 GB per token (the embedding lookup touches one row of its "
      "table), so at most ~16 tokens/s, of which real kernels reach perhaps 60-80%. Llama-3.2-1B "
      "manages at most ~24 tokens/s in fp16 and ~58 with 4-bit linears, but its 128k-entry "
      "embedding, tied to the LM head and left in fp16, is then half of the bytes read per "
      "token: quantize the output matrix too (llama.cpp's Q4_K_M stores it as Q6_K). The KV "
      "cache is small here (32 KiB per token, 128 MiB at 4k tokens) but grows with context, so "
      "cap the context. Pick 4-bit weights for both memory and speed (GGUF k-quants on CPU/GPU, "
      "or the INT4/INT8 formats the NPU toolchain supports, with INT8 or FP16 activations), keep "
      "the whole graph on the NPU (an unsupported operator, such as a fused attention, falls back "
      "to the CPU with copies each way), mmap the weights so the app starts at once, and expect "
      "thermal throttling in long sessions. Common wrong answer: 'the NPU does 40 TOPS, so "
      "generation will be fast'.",
      """
      from labkit.model.config import ModelConfig
      from labkit.quant.memory import estimate_memory, get_config
      from labkit.sim.presets import get_model_preset
      bandwidth = 60e9  # assumed phone LPDDR5X, bytes/s
      p = get_model_preset("llama-3.2-1b")
      small = ModelConfig(vocab_size=p.vocab_size, hidden_size=p.hidden_size,
                          intermediate_size=p.intermediate_size, num_hidden_layers=p.num_layers,
                          num_attention_heads=p.num_heads, num_key_value_heads=p.num_kv_heads,
                          head_dim=p.head_dim, tie_word_embeddings=True)
      def read_per_token(cfg, fmt):
          est = estimate_memory(cfg, fmt)
          lookup_only = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size * 2
          return est.weight_bytes - lookup_only, est
      for label, cfg in (("Llama-2-7B", get_config("llama-2-7b")), ("Llama-3.2-1B", small)):
          for fmt in ("fp16", "gptq"):
              read, est = read_per_token(cfg, fmt)
              fits = "fits" if est.weight_bytes < 12e9 else "does not fit"
              print(f"{label} {fmt}: {est.weight_bytes / 1e9:.2f} GB ({fits} in 12 GB), <= "
                    f"{bandwidth / read:.1f} tokens/s")
      _, est = read_per_token(small, "gptq")
      print(f"Llama-3.2-1B 4-bit: fp16 embedding/LM head = {est.other_bytes / est.weight_bytes:.0%}"
            f" of the bytes; KV {p.kv_bytes_per_token // 1024} KiB/token")
      assert estimate_memory("llama-2-7b", "fp16").weight_bytes > 12e9
      assert est.other_bytes > 0.45 * est.weight_bytes
      """),
    d("safety-review", "safety",
      "Prompts and responses must pass a safety classifier (a guard model such as Llama Guard) "
      "without the chat feeling slower. Where do the checks go, and what does each cost?",
      "Input: start the guard and the main model's prefill together and hold back only the "
      "first token until the verdict arrives, so TTFT is max(prefill, check) instead of their "
      "sum. For a 2,000-token prompt on an A100, Llama-2-7B's prefill takes about 90 ms; a 1B "
      "guard (Llama Guard 3 1B is built on Llama-3.2-1B) about 17 ms, fully hidden; an 8B guard "
      "about 107 ms, which makes the guard itself the critical path, so guard size is a latency "
      "decision. Cascade to keep the cost down: patterns and block lists in microseconds, a "
      "small classifier for most traffic, the large guard only for unclear cases, and cached "
      "verdicts for repeated system prompts. Output: text cannot be judged before it exists, so "
      "check it in windows (say every 16 tokens, with the conversation's KV cached so each check "
      "is a short prefill). Either release each window after it passes, so the stream lags by "
      "window x TPOT + check time (about 250 ms here), or stream at once and stop (and retract) "
      "on a violation, which lets a few unsafe tokens reach the user. If the guard times out or "
      "is down, policy decides: fail closed (refuse: safe) or fail open (serve: available); "
      "choose per product and alert either way. Common wrong answer: 'check the complete "
      "response before sending anything', which gives up streaming: the user waits the whole "
      "end-to-end latency.",
      """
      from labkit.sim.cost import step_time
      gpu, prompt, window = "a100-80gb", 2000, 16
      main = step_time("llama-2-7b", gpu, prompt, 0, 0)
      for guard_model in ("llama-3.2-1b", "llama-3-8b"):  # Llama Guard 3 1B / 8B backbones
          guard = step_time(guard_model, gpu, prompt, 0, 0)
          print(f"{guard_model} guard {guard * 1e3:.0f} ms: TTFT serial {(main + guard) * 1e3:.0f}"
                f" ms, in parallel {max(main, guard) * 1e3:.0f} ms")
      tpot = step_time("llama-2-7b", gpu, 0, 32, 32 * 1024)  # batch 32 decode
      check = step_time("llama-3.2-1b", gpu, window, 0, prompt)  # window over cached context
      print(f"output held back per {window}-token window: {(window * tpot + check) * 1e3:.0f} ms "
            f"(TPOT {tpot * 1e3:.1f} ms, check {check * 1e3:.1f} ms)")
      assert step_time("llama-3.2-1b", gpu, prompt, 0, 0) < main < step_time(
          "llama-3-8b", gpu, prompt, 0, 0)
      """),
]
