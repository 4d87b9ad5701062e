"""Drill bank, part 2: quantization, speculative decoding, latency metrics, MoE, and the
frameworks (llama.cpp / GGUF, TensorRT-LLM, vLLM vs Transformers). Data only."""

from __future__ import annotations

from labkit.exercises.drills_core import d

MODELS = [
    d("quant-memory", "quantization",
      "How much memory do Llama-2-7B's weights take in fp16, INT8, INT4 (GPTQ) and NF4?",
      "About 13.5 GB in fp16 (6.7 B parameters x 2 bytes). INT8 halves the linear layers; 4-bit "
      "formats take about a quarter plus a scale (and zero) per group; embeddings and the LM head "
      "usually stay in fp16, so INT4 lands near 3.9 GB, which fits a consumer GPU.",
      """
      from labkit.quant.memory import estimate_memory
      for fmt in ("fp16", "int8", "gptq", "nf4"):
          gb = estimate_memory("llama-2-7b", fmt).weight_bytes / 1e9
          print(f"{fmt:>5}: {gb:5.1f} GB")
      assert round(estimate_memory("llama-2-7b", "fp16").weight_bytes / 1e9, 1) == 13.5
      assert round(estimate_memory("llama-2-7b", "gptq").weight_bytes / 1e9, 1) == 3.9
      """),
    d("quant-decode-speed", "quantization",
      "Why does weight-only quantization speed up decode but barely prefill?",
      "Decode at small batch is memory-bound: each step reads all the weights for a handful of "
      "tokens, so 4x fewer weight bytes is close to 4x faster. Prefill processes thousands of "
      "tokens per weight read and is compute-bound; weights are dequantized to fp16 before the "
      "matmul, so the FLOPs are unchanged.",
      """
      from labkit.sim.cost import step_cost
      dec = step_cost("llama-2-7b", "a100-80gb", 0, 1, 512)
      pre = step_cost("llama-2-7b", "a100-80gb", 2048, 0, 0)
      print(f"decode bound by {dec.bound}, prefill bound by {pre.bound}")
      assert dec.bound == "memory" and pre.bound == "compute"
      """),
    d("quant-per-channel", "quantization",
      "Why quantize INT8 weights per output channel instead of per tensor?",
      "One scale must cover the largest value it applies to. Rows of a weight matrix differ in "
      "range by orders of magnitude, so a per-tensor scale wastes most of the 255 levels on small "
      "rows. A scale per output channel costs one float per row and cuts the error sharply; "
      "activation outliers need more (LLM.int8 keeps outlier features in fp16, SmoothQuant "
      "migrates them into the weights).",
      """
      import torch
      from labkit.quant.rtn import dequantize_int8, quantize_int8
      g = torch.Generator().manual_seed(0)
      w = torch.randn(64, 256, generator=g) * torch.logspace(-2, 0, 64)[:, None]
      per_channel = (dequantize_int8(*quantize_int8(w)) - w).pow(2).mean()
      s = w.abs().max() / 127
      per_tensor = ((w / s).round().clamp(-127, 127) * s - w).pow(2).mean()
      print(f"MSE per-channel {per_channel:.2e}, per-tensor {per_tensor:.2e}")
      assert per_channel < per_tensor / 3
      """),
    d("quant-gptq-awq", "quantization",
      "RTN, GPTQ, AWQ: what is the difference?",
      "Round-to-nearest quantizes each group independently. GPTQ quantizes columns one at a time "
      "and updates the not-yet-quantized columns to compensate for each rounding error, using the "
      "inverse Hessian of the layer's inputs from calibration data. AWQ notices that a few input "
      "channels with large activations matter most, scales those weights up (and the activations "
      "down) before rounding so they lose less precision. Both beat RTN at 4 bits; smaller groups "
      "help every method at a cost in scale storage.",
      """
      import torch
      from labkit.quant.rtn import fake_quantize
      w = torch.randn(128, 512, generator=torch.Generator().manual_seed(0))
      errs = {gs: (fake_quantize(w, 4, gs) - w).pow(2).mean().item() for gs in (32, 128, -1)}
      print({f"group {gs}": f"{e:.2e}" for gs, e in errs.items()})
      assert errs[32] < errs[128] < errs[-1]
      """),
    d("quant-nf4", "quantization",
      "What is NF4 and why does QLoRA use it?",
      "NormalFloat-4 puts its 16 levels at quantiles of a normal distribution, so normally "
      "distributed weights use every level about equally often: lower error than a uniform 4-bit "
      "grid for the same bits. Blocks of 64 share an absmax scale; double quantization stores "
      "those scales in 8 bits. bitsandbytes implements it; QLoRA trains LoRA adapters on top of "
      "a frozen NF4 base model.",
      """
      import torch
      from labkit.quant.nf4 import quantize_nf4
      w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
      nf4 = (quantize_nf4(w, blocksize=64).dequantize() - w).pow(2).mean()
      blocks = w.reshape(-1, 64)
      s = blocks.abs().amax(1, keepdim=True) / 7
      uniform = ((blocks / s).round().clamp(-8, 7) * s - blocks).pow(2).mean()
      print(f"MSE NF4 {nf4:.2e} vs uniform absmax INT4 {uniform:.2e}")
      assert nf4 < uniform
      """),
    d("quant-tools", "quantization",
      "Which quantization tool for which deployment?",
      "bitsandbytes (NF4/INT8) for quick loading and QLoRA fine-tuning in Transformers; GPTQ "
      "(GPTQModel, the maintained successor of AutoGPTQ) and AWQ (AutoAWQ is deprecated; vLLM's "
      "llm-compressor carries its AWQ on) for 4-bit checkpoints served fast by vLLM or SGLang "
      "(TGI serves them too, but has been in maintenance mode since December 2025); llama.cpp's "
      "GGUF k-quants for CPUs, Apple silicon and edge devices; FP8 in TensorRT-LLM or vLLM on "
      "GPUs with FP8 tensor cores: Ada (L4, L40S), Hopper (H100, H200) and Blackwell (B200, "
      "GB200, B300). FP4 formats (NVFP4, MXFP4) run on tensor cores only on Blackwell; Hopper "
      "has FP8 but no FP4 tensor cores, so an FP4 checkpoint there is dequantized for the matmul "
      "(weight-only, memory saved but no FP4 compute). Evaluate with perplexity plus task "
      "benchmarks before shipping."),
    d("spec-speedup", "speculative-decoding",
      "Speculative decoding: how many tokens per target step, and what speed-up?",
      "With per-token acceptance rate a and g draft tokens, a target step emits "
      "(1 - a^(g+1)) / (1 - a) tokens on average (the accepted drafts plus one target token). "
      "If a draft step costs c target steps, the speed-up is that divided by (g*c + 1). At a = "
      "0.8, g = 4, c = 0.05 that is 3.4 tokens per step and about 2.8x.",
      """
      from labkit.spec.theory import expected_speedup, expected_tokens_per_step
      tokens = expected_tokens_per_step(0.8, 4)
      speedup = expected_speedup(0.8, 4, 0.05)
      print(f"{tokens:.2f} tokens/step, {speedup:.2f}x")
      assert abs(tokens - 3.3616) < 1e-3 and 2.7 < speedup < 2.9
      """),
    d("spec-exact", "speculative-decoding",
      "Why is speculative sampling's output distribution exactly the target's?",
      "Accept a draft token x with probability min(1, p(x)/q(x)); on rejection sample from "
      "normalize(max(0, p - q)). The chance of emitting y is min(p, q)(y) from acceptance plus "
      "max(0, p - q)(y) from the residual, which sums to p(y). A bad draft only lowers the "
      "acceptance rate, never the quality.",
      """
      import torch
      from labkit.spec.rejection import rejection_sample
      p = torch.tensor([0.6, 0.3, 0.1, 0.0])
      q = torch.tensor([0.1, 0.2, 0.3, 0.4])
      g = torch.Generator().manual_seed(0)
      counts = torch.zeros(4)
      for _ in range(4000):
          x = int(torch.multinomial(q, 1, generator=g))
          emitted, _ = rejection_sample([x], q[None], torch.stack([p, p]), generator=g)
          counts[emitted[0]] += 1
      freq = counts / counts.sum()
      print("emitted frequencies", freq.tolist(), "target", p.tolist())
      assert (freq - p).abs().max() < 0.03
      """),
    d("spec-hurts", "speculative-decoding",
      "When does speculative decoding not pay off?",
      "When acceptance is low (a weak draft, high temperature, or text unlike the draft's "
      "training), when the draft is not much cheaper than the target, and at large batch sizes "
      "where the target is already compute-bound so verifying g extra tokens is no longer free. "
      "Then the draft's cost dominates and the speed-up drops below 1.",
      """
      from labkit.spec.theory import expected_speedup
      for alpha, gamma, c in [(0.8, 4, 0.05), (0.3, 4, 0.2), (0.5, 8, 0.3)]:
          print(f"alpha {alpha}, gamma {gamma}, c {c}: {expected_speedup(alpha, gamma, c):.2f}x")
      assert expected_speedup(0.3, 4, 0.2) < 1.0
      """),
    d("metrics-defs", "metrics",
      "Define TTFT, TPOT, ITL and E2E latency. Which one does a chat user feel?",
      "TTFT (time to first token) = first token time - arrival: queueing plus prefill, what a "
      "chat user feels first. TPOT (time per output token) = (last token - first token) / (n - 1): "
      "decode speed, which should beat reading speed. ITL is each gap between tokens (its tail "
      "shows stalls). E2E = finish - arrival = TTFT + (n - 1) x TPOT. SLOs are set on P50 and "
      "P99 of each.",
      """
      from labkit.engine.metrics import compute_metrics
      timings = [{"arrival_time": 0.0, "first_token_time": 0.25,
                  "token_times": [0.25, 0.30, 0.35, 0.40], "finish_time": 0.40}]
      m = compute_metrics(timings)
      print({k: round(m[k]["mean"], 3) for k in ("ttft", "tpot", "e2e")})
      assert abs(m["ttft"]["mean"] - 0.25) < 1e-9 and abs(m["tpot"]["mean"] - 0.05) < 1e-9
      """),
    d("metrics-roofline", "metrics",
      "What TPOT can Llama-2-7B reach at batch 1 on an A100 versus an H100, and why?",
      "Batch-1 decode reads all 13.5 GB of weights per token, so TPOT is about weight bytes / "
      "memory bandwidth: ~7 ms on an A100 (2 TB/s), ~4 ms on an H100 (3.35 TB/s). FLOP/s barely "
      "matter here; bandwidth does.",
      """
      from labkit.sim.cost import step_time
      for gpu in ("a100-80gb", "h100-sxm"):
          t = step_time("llama-2-7b", gpu, 0, 1, 512)
          print(f"{gpu}: TPOT ~{t * 1e3:.1f} ms -> {1 / t:.0f} tokens/s")
      assert step_time("llama-2-7b", "h100-sxm", 0, 1, 512) < step_time(
          "llama-2-7b", "a100-80gb", 0, 1, 512)
      """),
    d("metrics-tradeoff", "metrics",
      "Throughput versus latency: what does a bigger batch cost?",
      "A bigger decode batch raises tokens/s nearly linearly while weight reads dominate, and "
      "each step (the TPOT every user sees) grows only slowly, until KV reads and compute take "
      "over. Operators pick the largest batch whose P99 TPOT still meets the SLO; long prefills "
      "in the same step hurt TPOT, which chunked prefill bounds.",
      """
      from labkit.sim.cost import step_time
      rows = []
      for batch in (1, 8, 32, 128):
          t = step_time("llama-2-7b", "a100-80gb", 0, batch, batch * 1024)
          rows.append((batch, t * 1e3, batch / t))
          print(f"batch {batch:>3}: TPOT {t * 1e3:5.1f} ms, {batch / t:6.0f} tokens/s")
      assert rows[-1][2] > 10 * rows[0][2] and rows[-1][1] > rows[0][1]
      """),
    d("moe", "moe",
      "Mixtral-8x7B has 47B parameters; why does it run like a 13B model, and what does that cost?",
      "Each MoE layer has 8 expert MLPs and a router that sends every token to its top 2, so a "
      "token touches attention plus 2 of 8 experts: about 13B active parameters per token. All "
      "47B must still sit in memory, and at large batch every expert gets tokens, so memory and "
      "bandwidth look like a 47B model. With expert parallelism, tokens travel to their experts' "
      "GPUs and back: two all-to-all exchanges per MoE layer, a major cost across nodes. In "
      "labkit: an MoE checkpoint runs with LLM(..., tensor_parallel_size=2, "
      "enable_expert_parallel=True), whose trace counts those bytes (layers x tokens x top-k x "
      "hidden x dtype, each way); labkit bench moe measures it beside the loop and the fused "
      "kernel.",
      """
      layers, d_model, ffn, vocab, experts, top_k = 32, 4096, 14336, 32000, 8, 2
      attn = d_model * (32 * 128) * 2 + d_model * (8 * 128) * 2  # q,o + k,v (GQA 32/8)
      expert = 3 * d_model * ffn
      total = layers * (attn + experts * expert) + 2 * vocab * d_model
      active = layers * (attn + top_k * expert) + 2 * vocab * d_model
      a2a = 2 * top_k * d_model * 2  # bytes per token per MoE layer, bf16, out and back
      print(f"total {total / 1e9:.1f}B, active {active / 1e9:.1f}B, "
            f"all-to-all {a2a / 1024:.0f} KiB/token/layer")
      assert 46e9 < total < 47.5e9 and 12.5e9 < active < 13.5e9
      """),
    d("moe-ep-comm", "moe",
      "Expert parallelism for DeepSeek-V3 (671B, 256 experts, top-8): does it fit one node of 8 "
      "H200s, and what does a second node cost the all-to-all?",
      "In FP8 the weights take about 625 GiB. With the experts spread over 8 GPUs and attention "
      "replicated (data parallel, since the MLA cache cannot be split by head), each GPU holds "
      "about 92 GiB of its 141: it fits (in bf16 it would need 184 GiB per GPU). Every MoE layer "
      "dispatches tokens x 8 x 7168 x 2 bytes to the experts and combines as many back. On one "
      "node 7/8 of a GPU's rows cross NVLink at 450 GB/s each way; on two nodes half of them "
      "leave through the GPU's own 50 GB/s NIC, so the same step's all-to-all takes about 2.6x "
      "longer although each GPU receives half as many rows. A skewed router makes it worse, "
      "because the busiest GPU sets the pace; EPLB re-places experts by load and copies the "
      "hottest ones into spare slots, bringing max/mean near 1 at the cost of those copies' "
      "memory. In labkit: labkit.sim.expert (ep_table, ep_plan, eplb).",
      """
      import dataclasses
      from labkit.sim.expert import ep_plan, ep_table
      from labkit.sim.presets import get_model_preset
      one, two = ep_table("deepseek-v3", "h200", layouts=(8, 16), tokens=4096)
      for r in (one, two):
          print(f"{r['gpus']} GPUs on {r['nodes']} node(s): {r['weights_GiB_per_gpu']:.0f} GiB "
                f"of weights per GPU, all-to-all {r['all_to_all_ms']:.1f} ms a step, "
                f"max/mean {r['imbalance']:.2f}, after EPLB {r['imbalance_eplb']:.2f}")
      bf16 = dataclasses.replace(get_model_preset("deepseek-v3"), dtype_bytes=2)
      print("bf16 on 8 GPUs:", ep_plan(bf16, "h200", 8).why)
      ratio = two["all_to_all_ms"] / one["all_to_all_ms"]
      print(f"two nodes / one node: {ratio:.1f}x")
      assert one["fits"] and not ep_plan(bf16, "h200", 8).fits and 2.4 < ratio < 2.8
      """),
    d("gguf", "llama-cpp",
      "What is GGUF, and what does Q4_0 store?",
      "GGUF is llama.cpp's single-file format: metadata (architecture, tokenizer, hyper-"
      "parameters) plus tensors, laid out so the file can be memory-mapped and used without "
      "copying. Q4_0 stores blocks of 32 weights as 4-bit codes plus one fp16 scale: 4.5 bits "
      "per weight, symmetric. K-quants (Q4_K_M etc.) add super-blocks with quantized scales and "
      "mixed precision per tensor for better quality at similar size.",
      """
      import torch
      from labkit.quant.rtn import fake_quantize
      bits = (32 * 4 + 16) / 32
      w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
      err = (fake_quantize(w, 4, 32, sym=True) - w).pow(2).mean() / w.pow(2).mean()
      print(f"Q4_0-like: {bits} bits/weight, relative MSE {err:.3f}; "
            f"7B model ~{6.74e9 * bits / 8 / 1e9:.1f} GB")
      assert bits == 4.5 and err < 0.02
      """),
    d("llama-cpp-offload", "llama-cpp",
      "llama.cpp on a laptop with an 8 GB GPU: how does it run a model that does not fit?",
      "It keeps as much of the model as fits on the GPU and runs the rest on the CPU, reading "
      "those weights straight from the memory-mapped GGUF file. Recent llama.cpp decides the "
      "split itself: --fit (on by default) sets whatever you left unset, the number of GPU "
      "layers (-ngl auto) and the context size, to fit the free device memory; -ngl N or -ngl "
      "all still fixes the layer count by hand. Placement also goes per tensor, not only per "
      "layer: -ot / --override-tensor sends the tensors whose names match a pattern to a chosen "
      "buffer (say, some layers' FFN weights to the CPU), and for MoE models --n-cpu-moe N (or "
      "--cpu-moe) keeps the expert weights of the first N layers (or of all) in system RAM. That "
      "is the usual split for a big MoE on a small GPU: the experts are most of the bytes but "
      "each token reads only the few it is routed to, while attention and the shared weights, "
      "read by every token, stay on the GPU. Each token passes through both devices, so speed "
      "sits between pure-CPU and pure-GPU; quantization decides how much fits.",
      """
      from labkit.quant.memory import estimate_memory
      layers = 80
      per_layer = estimate_memory("llama-2-70b", "gptq").quantized_bytes / layers
      fit = int(7e9 // per_layer)  # keep ~1 GB for KV and buffers
      print(f"~{per_layer / 1e6:.0f} MB per 4-bit layer -> {fit} of {layers} layers on the GPU")
      assert 10 < fit < layers
      # Mixtral-8x7B (32 layers, 8 experts, top-2): what --cpu-moe leaves on the GPU
      d_model, ffn, vocab = 4096, 14336, 32000
      experts = 32 * 8 * 3 * d_model * ffn
      dense = 32 * (2 * d_model * 4096 + 2 * d_model * 1024) + 2 * vocab * d_model
      bits = 4.5  # Q4_0-like
      print(f"experts {experts / (experts + dense):.0%} of the weights: {experts * bits / 8e9:.1f} "
            f"GB in RAM, {2 / 8 * experts * bits / 8e9:.1f} GB of it read per token; dense part "
            f"{dense * bits / 8e9:.1f} GB on the GPU")
      assert experts > 0.9 * (experts + dense) and dense * bits / 8 < 7e9
      """),
    d("trtllm", "tensorrt-llm",
      "What does TensorRT-LLM buy you, and what became of its engine compilation?",
      "It started as a compiler: build a TensorRT engine for one GPU architecture and shape "
      "range, with fused kernels (QKV projection, attention, norm with residual, activation with "
      "matmul) that cut memory round-trips and launch overhead, and kernel auto-tuning. The price"
      " was build time and engines tied to GPU and version. In the 1.x releases its default "
      "backend is PyTorch (no engine build, Hugging Face checkpoints load directly) and the "
      "newest releases removed the TensorRT engine backend; what you pick it for now is the same "
      "library of hand-tuned NVIDIA kernels (attention, FP8/FP4/INT4 GEMMs on tensor cores, FP4 on"
      " Blackwell only), in-"
      "flight (continuous) batching and a paged, reusable KV cache.",
      """
      hidden, bytes_per = 4096, 2
      tokens = 2048
      # residual add then RMSNorm, unfused: read x, r -> write h; read h -> write y
      unfused = tokens * hidden * bytes_per * (2 + 1 + 1 + 1)
      fused = tokens * hidden * bytes_per * (2 + 1 + 1)  # read x, r; write h and y once
      print(f"unfused {unfused / 2**20:.0f} MiB, fused {fused / 2**20:.0f} MiB of traffic")
      assert fused < unfused
      """),
    d("cuda-graphs", "tensorrt-llm",
      "Why do engines capture CUDA graphs per batch size, and why can vLLM capture a decode "
      "batch whole but a batch with prefill chunks only piecewise?",
      "A decode step of a small batch launches hundreds of small kernels, and each launch costs "
      "the host microseconds, so the step waits on Python and the driver, not on the GPU. A CUDA "
      "graph records the launches once and replays them with one call, but it freezes every "
      "shape and buffer address: engines capture one graph per padded batch size (vLLM's "
      "cudagraph_capture_sizes 1, 2, 4, 8, ..., 512) and pad each step up to the next size. "
      "Attention is the part whose work depends on the step. In a uniform decode batch every "
      "sequence brings one query and the kernel reads the block tables and context lengths "
      "from fixed buffers, so the whole step, attention included, is one graph. A batch mixing "
      "prefill chunks of any length is captured piecewise: graphs between the attention calls, "
      "attention run eagerly between them. vLLM's default cudagraph_mode FULL_AND_PIECEWISE does "
      "both. The price is capture time at start-up and memory for each size's buffers; a batch "
      "larger than the largest size runs eager. labkit's compile=True does the same on a CPU "
      "with inductor (notebook 15 §4.2b times both; labkit bench step measured fused + "
      "compiled at 1.8x fused + piecewise at batch 1).",
      """
      import bisect
      from labkit.engine.full_graph import block_bucket
      sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # vLLM's default capture sizes
      def padded(n):
          return sizes[bisect.bisect_left(sizes, n)]
      waste = sum(padded(n) - n for n in range(1, 513)) / sum(range(1, 513))
      print(f"padding every batch of 1..512 to a capture size computes {waste:.0%} extra rows")
      buckets = sorted({block_bucket(w) for w in range(1, 65)})
      print("labkit's block buckets for 1..64 blocks of context:", buckets)
      assert padded(3) == 4 and padded(33) == 64 and waste < 0.5
      assert buckets == [4, 8, 16, 32, 64]
      """),
    d("attention-op", "tensorrt-llm",
      "In a compiled decode step, why do engines call a hand-written attention kernel as one "
      "opaque op instead of letting the compiler generate attention, and when does the call "
      "out of the graph not pay?",
      "A compiler fuses elementwise chains well and calls library GEMMs, but decode attention "
      "over a paged cache is a gather through block tables plus a softmax reduction, and the "
      "loop nest that makes it fast (each K and V row loaded once for every query head that "
      "shares it, only each sequence's own keys read, the softmax along the keys) is not what "
      "generic fusion produces. vLLM registers its attention as a custom op (unified_attention, "
      "with a fake implementation for tracing), so torch.compile sees one node: piecewise "
      "graphs split there and full CUDA graphs capture the kernel inside. The op is opaque: "
      "nothing fuses across it and the call has a cost of its own, so for a small step generated "
      "code can win, and engines choose kernels by the batch's shape. labkit measures both on a "
      "CPU: inductor's loops for labkit-tiny's attention at batch 32 take about 4x its C++ op "
      "per layer, while at batch 1 and 8 the op's call (about 60 us a layer) makes the step "
      "0.35 ms slower, so its full graphs call the op only from 2048 sequence x bucket keys.",
      """
      from labkit.engine.full_graph import KERNEL_MIN_KEYS, block_bucket
      bs = 16  # tokens per block
      def uses_op(batch, context):
          return batch * block_bucket(-(-context // bs)) * bs >= KERNEL_MIN_KEYS
      print({(b, c): uses_op(b, c) for b in (1, 8, 16, 32) for c in (50, 100)})
      assert uses_op(32, 50) and uses_op(16, 100)
      assert not uses_op(8, 100) and not uses_op(1, 1000)
      """),
    d("frameworks", "frameworks",
      "Why is vLLM faster than plain Hugging Face Transformers generate, and when would you pick "
      "something else?",
      "Transformers' generate pads a static batch that runs until its longest sequence "
      "finishes, and its default DynamicCache grows each layer's K and V tensors by "
      "concatenation at every step (StaticCache instead pre-allocates max_cache_len tokens per "
      "sequence, for torch.compile). vLLM pages the KV cache (more sequences fit), batches "
      "continuously (no idle slots), shares prefixes and uses fused kernels, so throughput is "
      "several times higher under load. Recent Transformers versions add generate_batch, a "
      "continuous-batching path with a paged cache; vLLM is still the engine built around these "
      "ideas end to end. "
      "Pick TensorRT-LLM for the last bit of NVIDIA performance, SGLang for heavy prefix reuse "
      "(RadixAttention) and structured "
"programs, llama.cpp or Ollama for CPUs, laptops and edge devices."),
    d("compression", "compression",
      "Quantization, distillation and pruning: how do they differ, and how are they combined?",
      "Quantization keeps the model and stores it in fewer bits. Distillation trains a smaller "
      "student to match a teacher's output distribution (soft labels), changing the "
      "architecture. Pruning removes weights: unstructured sparsity needs sparse kernels to pay "
      "off, structured pruning (heads, channels, layers) speeds up ordinary hardware. A common "
      "pipeline distills, then prunes, then quantizes; in LLM serving quantization is by far the "
      "most used."),
]
