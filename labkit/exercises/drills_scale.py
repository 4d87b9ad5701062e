"""Drill bank, part 4: scaling out and shipping — tensor and pipeline parallelism, loading
weights fast, and keeping a fleet up while its model changes. Data only.

Numbers come from labkit's presets (``labkit.sim.presets``), roofline (``labkit.sim.cost``) and
memory calculator (``labkit.quant.memory``). Hardware figures labkit has no preset for
(interconnects, disks, object storage) are named constants inside each snippet, stated as
assumptions so a learner can change them and rerun.
"""

from __future__ import annotations

from labkit.exercises.drills_core import d

SCALE = [
    d("tp-split", "parallelism",
      "Llama-2-70B runs with Megatron-style tensor parallelism on 8 H100-80GB GPUs. What does "
      "each GPU hold, how many all-reduces does one layer's forward pass need, and how much more "
      "KV cache fits than with TP=4?",
      "Tensor parallelism splits every layer's matrices, not the list of layers. Attention is "
      "split by heads: q/k/v_proj are column-parallel (each GPU computes its own query heads and "
      "KV heads) and o_proj is row-parallel; in the MLP gate/up_proj are column-parallel (each "
      "GPU owns a slice of the intermediate dimension) and down_proj is row-parallel. A "
      "row-parallel matmul leaves every GPU with a partial sum of the full [tokens, hidden] "
      "output, so each layer's forward pass needs two all-reduces, one after attention and one "
      "after the MLP (the vocab-parallel embedding and LM head add one all-reduce and one gather "
      "per step). Weights per GPU: 138 GB / 8 = 17.2 GB. The KV cache splits with the heads: "
      "each GPU stores 1 of the 8 KV heads, 40 KiB per token instead of 320 KiB. At 90% of "
      "80 GiB that leaves room for about 1.47M tokens (every GPU holds its slice of every "
      "token, so that is the group's capacity) against 0.52M at TP=4: 2.8x, not 2x, because "
      "the weights per GPU shrink too. Past TP = num_kv_heads a GPU cannot hold half a head, so "
      "KV heads are replicated: TP=16 halves the weights per GPU again but not the KV each GPU "
      "stores per token. Common wrong answer: 'each GPU gets some of the layers' (that is pipeline "
      "parallelism) or 'the KV cache is replicated on every GPU'.",
      """
      from labkit.sim.presets import get_gpu, get_model_preset
      m, gpu = get_model_preset("llama-2-70b"), get_gpu("h100-sxm")
      def per_gpu(tp):
          weights = m.weight_bytes / tp  # norms are replicated but tiny
          kv_heads = max(1, m.num_kv_heads // tp)  # replicated once tp > kv heads
          kv = m.kv_bytes_per_token * kv_heads // m.num_kv_heads
          return weights, kv, int((0.9 * gpu.mem_bytes - weights) // kv)
      for tp in (4, 8, 16):
          w, kv, tokens = per_gpu(tp)
          print(f"TP={tp}: weights {w / 1e9:.2f} GB/GPU, KV {kv} B/token/GPU, "
                f"KV room {tokens} tokens")
      print(f"all-reduces per forward pass: {2 * m.num_layers} (2 per layer)")
      assert per_gpu(8)[2] > 2.5 * per_gpu(4)[2] and per_gpu(16)[1] == per_gpu(8)[1]
      """),
    d("tp-vs-pp", "parallelism",
      "Tensor or pipeline parallelism for Llama-2-70B on 8 GPUs: how many bytes does each move "
      "per generated token, what happens to batch-1 latency, and which do you use inside a node "
      "and which across nodes?",
      "TP does two all-reduces of the [tokens, hidden] activations per layer. A ring all-reduce "
      "makes each GPU send (and receive) 2 x (TP-1)/TP times the message, so per token and layer "
      "each GPU sends 2 x 2 x (TP-1)/TP x hidden x bytes = 57,344 bytes at TP=8 with hidden 8192 "
      "in bf16, 4.6 MB over 80 layers. PP gives each stage a run of consecutive layers and only "
      "hands each token's activation across a stage boundary, point to point: 16 KiB per token "
      "for one bf16 hidden vector (32 KiB where the engine also sends the residual, as vLLM "
      "does), over a hundred times less traffic. Latency: with TP all eight GPUs work on every "
      "layer at once, each reading 1/8 of the weights, so a batch-1 token takes about 5 ms on "
      "H100s plus 160 small all-reduces whose fixed latency (not bandwidth) is what hurts at "
      "batch 1. With PP the stages run one after another, so one token still waits for all 138 GB"
      " to be read (about 41 ms, no better than one GPU big enough); PP raises throughput only "
      "with several micro-batches in flight and leaves bubbles when there are too few. Bandwidth "
      "decides where each goes: a 2,048-token prefill at TP=8 moves 9.4 GB per GPU, about 21 ms "
      "over NVLink (450 GB/s each way) against 36 ms of compute, but about 190 ms over a 400 Gb/s"
      " InfiniBand link. So TP inside an NVLink node, PP across nodes (vLLM: tensor_parallel_size"
      " = GPUs per node, pipeline_parallel_size = number of nodes). Common wrong answer: "
      "'pipeline parallelism makes a single request faster'.",
      """
      from labkit.sim.presets import get_gpu, get_model_preset
      m, gpu, n = get_model_preset("llama-2-70b"), get_gpu("h100-sxm"), 8
      act = m.hidden_size * m.dtype_bytes  # one token's activation
      tp_bytes = m.num_layers * 2 * (2 * (n - 1) / n * act)  # 2 ring all-reduces per layer
      print(f"per token: TP sends {tp_bytes:,.0f} B per GPU; PP sends {act:,} B per boundary")
      slice_read = m.weight_bytes / n / gpu.mem_bandwidth
      tp_decode, pp_decode = slice_read, n * slice_read  # parallel slices vs stages in turn
      print(f"batch-1 decode: TP {tp_decode * 1e3:.1f} ms/token, PP {pp_decode * 1e3:.1f} ms/token")
      prefill = 2048
      compute = 2 * m.num_params * prefill / n / gpu.peak_flops
      links = {"NVLink, 450 GB/s each way": 450e9, "InfiniBand NDR, 50 GB/s": 50e9}
      for link, bw in links.items():
          print(f"{prefill}-token prefill at TP={n}: all-reduce {tp_bytes * prefill / bw * 1e3:.0f}"
                f" ms over {link}, compute {compute * 1e3:.0f} ms")
      assert tp_bytes > 250 * act and pp_decode == n * tp_decode
      assert tp_bytes * prefill / 450e9 < compute < tp_bytes * prefill / 50e9
      """),
    d("safetensors-mmap", "weight-loading",
      "What is inside a .safetensors file, and what does memory-mapping it actually save when a "
      "server loads a model?",
      "An 8-byte little-endian header length, a JSON header that maps each tensor name to its "
      "dtype, shape and [begin, end) byte offsets, then the raw tensor bytes back to back. There "
      "is no pickle, so loading cannot execute code (torch.load of a .bin file unpickles; only "
      "its weights_only mode, the default since PyTorch 2.6, restricts what that may build), and "
      "any tensor, or a range of its rows (safe_open(...).get_slice), is read without touching "
      "the rest, so each tensor-parallel rank reads only its own shard of each matrix. Loaders "
      "mmap the file: opening is instant because nothing is read until a page is touched, pages "
      "come from the OS page cache (shared by every process that maps the file and still warm "
      "after a restart), and no extra copy into a private buffer is made. The bytes are not "
      "free, though: the first forward pass, or the copy to the GPU, still pulls every byte "
      "from disk: cold, Llama-2-7B's 13.5 GB takes about 13 s from a 1 GB/s network disk and "
      "about 2 s from a 7 GB/s local NVMe drive, and scattered 4 KiB page faults can be slower "
      "than one sequential read; from a warm page "
      "cache the floor is the host-to-GPU copy, about 0.5 s over PCIe 4.0 x16 (~25 GB/s). "
      "llama.cpp on a CPU gains the most, because it computes straight from the mapped pages. "
      "Common wrong answer: 'mmap loads a 14 GB model in milliseconds': only the mapping is "
      "instant.",
      """
      import json
      import struct
      import torch
      from safetensors import safe_open
      from labkit.model.loader import resolve_model_path
      from labkit.quant.memory import estimate_memory
      path = resolve_model_path("labkit-tiny") / "model.safetensors"
      with open(path, "rb") as f:  # read the header only, not the tensors
          (n,) = struct.unpack("<Q", f.read(8))
          header = json.loads(f.read(n))
      header.pop("__metadata__", None)
      spans = sorted(info["data_offsets"] for info in header.values())
      data = path.stat().st_size - 8 - n
      assert spans[0][0] == 0 and spans[-1][1] == data  # tensors packed back to back
      assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
      name = "model.embed_tokens.weight"
      print(f"header {n} B for {len(header)} tensors, data {data} B; {name}: "
            f"{header[name]['dtype']} {header[name]['shape']} at {header[name]['data_offsets']}")
      with safe_open(str(path), framework="pt") as st:
          rows = st.get_slice(name)[:8]  # reads 8 rows' bytes, as a TP rank reads its shard
          assert torch.equal(rows, st.get_tensor(name)[:8])
      size = estimate_memory("llama-2-7b", "fp16").weight_bytes
      disks = {"1 GB/s network disk": 1e9, "7 GB/s local NVMe": 7e9}  # assumed bandwidths
      cold = ", ".join(f"{size / bw:.1f} s from a {name}" for name, bw in disks.items())
      pcie = 25e9  # PCIe 4.0 x16, host to GPU
      print(f"Llama-2-7B {size / 1e9:.1f} GB: cold {cold}; warm page cache to GPU "
            f"{size / pcie:.2f} s")
      """),
    d("cold-start", "weight-loading",
      "Llama-2-70B's weights sit in object storage (S3). A fresh 8-GPU node must start serving "
      "quickly. Where does the time go, and what do you do about it?",
      "The checkpoint is 138 GB in bf16. Through one GET stream (on the order of 100 MB/s per "
      "connection) that is over 20 minutes. Many parallel ranged GETs (8-16 MB ranges) over the "
      "checkpoint's shards make the node's NIC the limit: about 11 s at 100 Gb/s "
      "(12.5 GB/s), if the storage keeps up. A node-local NVMe cache at ~7 GB/s per drive takes "
      "about 20 s, and a restart that finds the files in the page cache pays only the "
      "host-to-GPU copies, each GPU loading its own 17 GB slice in parallel (about 0.7 s at "
      "25 GB/s). Two traps: if every tensor-parallel rank reads the whole checkpoint, the node "
      "moves 8 x 138 GB = 1.1 TB (about 88 s at 12.5 GB/s), so ranks should read only their "
      "slices; and download-then-load runs the stages one after another, while streaming shards "
      "to the GPUs as they arrive overlaps them. In practice: sharded safetensors fetched in "
      "parallel, rank-sliced loading, a node-local cache filled ahead of time (a DaemonSet or a "
      "caching file system in front of the bucket), and warm standby replicas, because no "
      "loader beats a replica that is already loaded. Common wrong answer: 'mount the bucket and "
      "mmap the file': without a local cache every page fault becomes a network round trip.",
      """
      from labkit.sim.presets import get_model_preset
      m, tp = get_model_preset("llama-2-70b"), 8
      size = m.weight_bytes
      paths = {  # assumed bandwidths, bytes/s
          "one S3 GET stream": 0.1e9,
          "parallel ranged GETs, 100 Gb/s NIC": 12.5e9,
          "local NVMe drive": 7e9,
      }
      for name, bw in paths.items():
          print(f"{name}: {size / bw:,.1f} s")
      warm = size / tp / 25e9  # each GPU copies its slice over its own PCIe link
      every_rank_reads_all = tp * size / 12.5e9
      print(f"{size / 1e9:.0f} GB; warm page cache to {tp} GPUs: {warm:.2f} s; every rank "
            f"reading the whole checkpoint over the NIC: {every_rank_reads_all:.1f} s")
      assert warm < size / 12.5e9 < every_rank_reads_all
      """),
    d("hot-update", "releases",
      "How do you roll a new model version onto a serving fleet without dropping in-flight "
      "requests, and what happens to the KV cache and the prefix cache?",
      "Take a replica out of rotation first (its readiness check fails, the gateway stops "
      "routing to it), let its running requests finish (drain), then stop it and start the new "
      "version, which takes traffic only after its weights are loaded and a warm-up request "
      "passes; repeat replica by replica with a spare (surge) so capacity never drops. Blue/green "
      "instead runs both versions fully and flips the router: instant rollback, twice the GPUs "
      "during the switch; an in-process swap (Triton Inference Server) needs memory for both "
      "weight sets. The drain must outlast the longest generation: 4,096 tokens at a 24 ms "
      "decode step (Llama-2-7B, batch 64, A100) is about 100 s, while Kubernetes kills a pod "
      "30 s after SIGTERM by default, so raise terminationGracePeriodSeconds and stop admission "
      "in a preStop hook, or the longest streams are cut off. A request must finish on the "
      "version it started on: its KV cache was computed by the old weights, and decoding with "
      "new weights over old KV is neither model. A fresh engine process starts with an empty "
      "prefix cache, but weights updated in place (as RL training loops do) or a KV cache "
      "shared between instances keep the trap: block keys hash token ids, not weights, so "
      "flush the cache (vLLM's reset_prefix_cache) or put the model version into the key, like "
      "a cache salt. Either way expect TTFT to rise until the new cache fills. "
      "When only a LoRA adapter changes, load the new adapter under a new name and switch "
      "routing; the base stays loaded. Common wrong answer: 'a Kubernetes rolling update is "
      "zero-downtime out of the box'.",
      """
      import torch
      from labkit.kv.prefix import hash_prompt_blocks
      from labkit.model.config import ModelConfig
      from labkit.model.generate import ContiguousKVCache
      from labkit.model.llama import LlamaForCausalLM
      from labkit.sim.cost import step_time
      step = step_time("llama-2-7b", "a100-80gb", 0, 64, 64 * 1024)
      print(f"drain for a 4096-token stream: {4096 * step:.0f} s at {step * 1e3:.1f} ms/step "
            f"(Kubernetes' default grace period: 30 s)")
      cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, max_position_embeddings=256)
      with torch.random.fork_rng(), torch.no_grad():
          torch.manual_seed(0)
          old, new = LlamaForCausalLM(cfg).eval(), LlamaForCausalLM(cfg).eval()
          new.load_state_dict(old.state_dict())
          for p in new.parameters():  # the fine-tuned successor
              p.add_(0.02 * torch.randn_like(p))
          ids, pos = torch.randint(0, 128, (1, 24)), torch.arange(24)[None]
          def next_logits(prefill_model):  # new model decodes over prefill_model's KV
              cache = ContiguousKVCache(prefill_model, 1, 32)
              prefill_model(ids[:, :-1], pos[:, :-1], kv_cache=cache)
              return new(ids[:, -1:], pos[:, -1:], kv_cache=cache)[0, -1]
          truth = new(ids)[0, -1]
          stale = (next_logits(old) - truth).abs().max().item()
          fresh = (next_logits(new) - truth).abs().max().item()
      print(f"new weights over old KV: max logit error {stale:.3f}; over its own KV: {fresh:.1e}")
      keys = {v: hash_prompt_blocks(list(range(64)), 16, cache_salt=v) for v in ("v1", "v2")}
      print("prefix blocks shared across versions:", len(set(keys["v1"]) & set(keys["v2"])))
      assert stale > 100 * fresh and not set(keys["v1"]) & set(keys["v2"])
      """),
]
