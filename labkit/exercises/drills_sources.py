"""Where each drill's statements about named systems come from. Data only.

A drill that says what vLLM, TGI, llama.cpp, ... does must point at the place in that system's
code or documentation that shows it: ``owner/repo: path`` (the file that implements it, read at
the versions current in 2025-26) or a documentation URL. Claims that changed between versions say
which version they describe. ``SYSTEMS`` lists the names the tests look for in every drill's
English text; a drill naming one needs a ``Claim`` for it here.
"""

from __future__ import annotations

from labkit.exercises.drills_core import Claim

# name -> regex that finds it in a drill's English text (word-bounded, case-sensitive as written).
SYSTEMS: dict[str, str] = {
    "vLLM": r"\bvLLM\b", "TGI": r"\bTGI\b", "TensorRT-LLM": r"\bTensorRT-\s?LLM\b",
    "SGLang": r"\bSGLang\b", "llama.cpp": r"\bllama\.cpp\b", "Ollama": r"\bOllama\b",
    "Transformers": r"\bTransformers\b", "bitsandbytes": r"\bbitsandbytes\b",
    "GPTQModel": r"\bGPTQModel\b", "AutoGPTQ": r"\bAutoGPTQ\b", "AutoAWQ": r"\bAutoAWQ\b",
    "Punica": r"\bPunica\b", "S-LoRA": r"\bS-LoRA\b", "Kubernetes": r"\bKubernetes\b",
    "Triton Inference Server": r"\bTriton Inference Server\b",
    "safetensors": r"\.safetensors\b|\bsafe_open\b", "PyTorch": r"\bPyTorch\b|\btorch\.load\b",
    "Megatron": r"\bMegatron\b", "Llama Guard": r"\bLlama Guard\b", "Prometheus": r"\bPrometheus\b",
    "MIG": r"\bMIG\b", "MPS": r"\bMPS\b", "SmoothQuant": r"\bSmoothQuant\b",
    "LLM.int8": r"\bLLM\.int8\b", "QLoRA": r"\bQLoRA\b", "PagedAttention": r"\bPagedAttention\b",
    "S3": r"\bS3\b", "Mixtral": r"\bMixtral\b", "LMCache": r"\bLMCache\b",
    "Sarathi-Serve": r"\bSarathi(-Serve)?\b", "DistServe": r"\bDistServe\b",
    "Splitwise": r"\bSplitwise\b",
}

VLLM = "vllm-project/vllm: "
TGI = "huggingface/text-generation-inference: "
TRANSFORMERS = "huggingface/transformers: "
LLAMA_CPP = "ggml-org/llama.cpp: "
TRTLLM_DOCS = "https://nvidia.github.io/TensorRT-LLM/"
PAGED_PAPER = "https://arxiv.org/abs/2309.06180 (Kwon et al., PagedAttention, SOSP 2023)"
QLORA_PAPER = "https://arxiv.org/abs/2305.14314 (Dettmers et al., QLoRA)"
BNB_4BIT = "bitsandbytes-foundation/bitsandbytes: bitsandbytes/functional.py (quantize_4bit)"
MIG_GUIDE = "https://docs.nvidia.com/datacenter/tesla/mig-user-guide/"
# Hugging Face put TGI in maintenance mode on 2025-12-11; every drill naming TGI says so.
TGI_MAINTENANCE = TGI + ("README.md (maintenance-mode notice, 2025-12-11, PRs #3344/#3345: minor "
                         "fixes only; recommends vLLM, SGLang, llama.cpp or MLX)")

SOURCES: dict[str, list[Claim]] = {
    "kv-capacity": [
        Claim("vLLM", "gpu_memory_utilization defaults to 0.9; KV blocks fill what the weights "
              "and the peak memory of a profiling run (activations of a max_num_batched_tokens "
              "forward, non-torch memory) leave of that share",
              VLLM + "vllm/config/cache.py (CacheConfig.gpu_memory_utilization); "
              "vllm/v1/worker/gpu_worker.py (determine_available_memory)"),
    ],
    "paged-why": [
        Claim("PagedAttention", "fixed-size KV blocks found through a block table; waste below "
              "one block per sequence", PAGED_PAPER),
    ],
    "block-size": [
        Claim("vLLM", "the block size defaults to 16 tokens on CUDA GPUs",
              VLLM + "vllm/platforms/cuda.py (check_and_update_config: block_size = 16)"),
    ],
    "prefix-hash": [
        Claim("vLLM", "a block's key hashes its parent's key, its token ids and extra keys "
              "(LoRA, multimodal inputs, cache_salt); partial blocks get no key",
              VLLM + "vllm/v1/core/kv_cache_utils.py (hash_block_tokens, "
              "generate_block_hash_extra_keys)"),
        Claim("SGLang", "RadixAttention keeps cached prefixes in a radix tree of token sequences",
              "sgl-project/sglang: python/sglang/srt/mem_cache/radix_cache.py"),
    ],
    "prefix-last-token": [
        Claim("vLLM", "a full hit is capped at num_tokens - 1, which recomputes the whole last "
              "block because cached prefixes are block-aligned",
              VLLM + "vllm/v1/core/kv_cache_manager.py (get_computed_blocks: "
              "max_cache_hit_length)"),
    ],
    "prefix-evict": [
        Claim("vLLM", "a finished request's blocks are freed tail first, so tails are evicted "
              "first; free cached blocks are reused least recently used first",
              VLLM + "vllm/v1/core/kv_cache_manager.py (free); vllm/v1/core/block_pool.py "
              "(free_block_queue)"),
    ],
    "sched-decode-first": [
        Claim("vLLM", "the V1 scheduler spends the token budget on running requests first, then "
              "admits waiting ones; chunked prefill cuts the last prompt to the budget left",
              VLLM + "vllm/v1/core/sched/scheduler.py (schedule: running loop, then waiting "
              "loop, token_budget)"),
        Claim("vLLM", "V0's default scheduler batched waiting prefills first and scheduled decodes "
              "only in steps without a prefill; its chunked-prefill scheduler ran decodes first",
              VLLM + "vllm/core/scheduler.py (V0, _schedule_default, _schedule_chunked_prefill; "
              "removed with V0)"),
        Claim("Sarathi-Serve", "chunked prefills with stall-free (decode-first) batching; not "
              "disaggregation", "https://arxiv.org/abs/2403.02310 (Agrawal et al., Sarathi-Serve, "
              "OSDI 2024)"),
        Claim("DistServe", "prefill and decode on separate GPUs (disaggregation), each sized for "
              "its own latency target", "https://arxiv.org/abs/2401.09670 (Zhong et al., "
              "DistServe, OSDI 2024)"),
        Claim("Splitwise", "prompt and token phases on separate machines, KV shipped between them",
              "https://arxiv.org/abs/2311.18677 (Patel et al., Splitwise, ISCA 2024)"),
    ],
    "sched-preempt": [
        Claim("vLLM", "V1 preempts by freeing the victim's blocks and resetting its computed "
              "tokens to 0 (recompute), the freed blocks keeping their hashes",
              VLLM + "vllm/v1/core/sched/scheduler.py (schedule: preempted_req."
              "num_computed_tokens = 0); vllm/v1/core/kv_cache_manager.py (free)"),
        Claim("vLLM", "V0 chose recompute for single-sequence groups and swap for beam search",
              VLLM + "vllm/core/scheduler.py (V0, _preempt; removed with V0)"),
        Claim("vLLM", "V1 offloads KV blocks to a CPU pool through its offloading KV connector "
              "(--kv-offloading-size with the native backend, or LMCache) and loads a prefix "
              "found there back instead of recomputing it",
              VLLM + "vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py; "
              "vllm/config/cache.py (kv_offloading_size, kv_offloading_backend); "
              "https://blog.vllm.ai/2026/01/08/kv-offloading-connector.html"),
        Claim("LMCache", "a KV connector backend that stores vLLM's KV in CPU memory or on disk",
              "https://github.com/LMCache/LMCache (README); " + VLLM
              + "vllm/distributed/kv_transfer/kv_connector/v1/lmcache_connector.py"),
    ],
    "watermark": [
        Claim("TGI", "a request is admitted only if blocks for input + max_new_tokens can be "
              "allocated within the token budgets; it is never preempted afterwards",
              TGI + "backends/v3/src/queue.rs (State::next_batch, block_allocator.allocate)"),
        Claim("TGI", "max_batch_total_tokens, max_batch_prefill_tokens, waiting_served_ratio "
              "(default 0.3) and max_waiting_tokens (default 20)",
              TGI + "launcher/src/main.rs (Args); backends/v3/src/backend.rs (batching_task)"),
        Claim("vLLM", "V0: can_allocate admits only if free blocks minus the request's blocks stay "
              "at or above watermark_blocks = 0.01 x the GPU blocks",
              VLLM + "vllm/core/block_manager.py (V0, SelfAttnBlockSpaceManager.can_allocate)"),
        Claim("vLLM", "V1: allocate_slots only checks that enough free blocks exist; the "
              "scheduler preempts the last running request when a decode cannot get one",
              VLLM + "vllm/v1/core/kv_cache_manager.py (allocate_slots); "
              "vllm/v1/core/sched/scheduler.py (schedule)"),
        Claim("TGI", "in maintenance mode since December 2025", TGI_MAINTENANCE),
        Claim("SGLang", "one of the engines TGI's maintenance notice recommends", TGI_MAINTENANCE),
    ],
    "quant-per-channel": [
        Claim("LLM.int8", "outlier feature dimensions are kept in fp16 (mixed-precision "
              "decomposition)", "https://arxiv.org/abs/2208.07339 (Dettmers et al., LLM.int8())"),
        Claim("SmoothQuant", "migrates activation outliers into the weights with a per-channel "
              "scale", "https://arxiv.org/abs/2211.10438 (Xiao et al., SmoothQuant)"),
    ],
    "quant-nf4": [
        Claim("bitsandbytes", "NF4 with blocksize 64 by default; Linear4bit compresses the "
              "absmax statistics (double quantization) by default", BNB_4BIT
              + "; bitsandbytes/nn/modules.py (Linear4bit, compress_statistics=True)"),
        Claim("QLoRA", "LoRA adapters trained on a frozen NF4 base; 8-bit double-quantized "
              "scales", QLORA_PAPER),
    ],
    "quant-tools": [
        Claim("bitsandbytes", "NF4 and LLM.int8 loading in Transformers",
              "https://huggingface.co/docs/transformers/quantization/bitsandbytes"),
        Claim("QLoRA", "fine-tuning LoRA adapters on a 4-bit base", QLORA_PAPER),
        Claim("Transformers", "loads bitsandbytes, GPTQ and AWQ checkpoints",
              "https://huggingface.co/docs/transformers/quantization/overview"),
        Claim("AutoGPTQ", "development stopped; its README points users to GPTQModel",
              "https://github.com/AutoGPTQ/AutoGPTQ (README)"),
        Claim("GPTQModel", "the maintained GPTQ toolkit", "https://github.com/ModelCloud/GPTQModel"),
        Claim("AutoAWQ", "officially deprecated; AWQ adopted by vLLM's llm-compressor",
              "https://github.com/casper-hansen/AutoAWQ (README notice); "
              "huggingface/transformers issue #38078"),
        Claim("vLLM", "serves GPTQ, AWQ and FP8 checkpoints; FP8 compute on Ada, Hopper and "
              "Blackwell (compute capability 8.9+); NVFP4 on Blackwell",
              "https://docs.vllm.ai/en/latest/features/quantization/; "
              "https://docs.vllm.ai/en/latest/features/quantization/supported_hardware.html"),
        Claim("SGLang", "serves GPTQ, AWQ and FP8 checkpoints",
              "sgl-project/sglang: python/sglang/srt/layers/quantization/ (gptq.py, awq.py, "
              "fp8.py)"),
        Claim("TGI", "serves GPTQ and AWQ checkpoints (--quantize gptq / awq)",
              TGI + "docs/source/conceptual/quantization.md"),
        Claim("TGI", "in maintenance mode since December 2025", TGI_MAINTENANCE),
        Claim("llama.cpp", "GGUF k-quants for CPU, Metal and edge back ends",
              LLAMA_CPP + "ggml/src/ggml-quants.c; tools/quantize/README.md"),
        Claim("TensorRT-LLM", "FP8 on Ada, Hopper and Blackwell; NVFP4 on Blackwell only",
              TRTLLM_DOCS + "features/quantization.html; https://developer.nvidia.com/blog/"
              "introducing-nvfp4-for-efficient-and-accurate-low-precision-inference/"),
    ],
    "gguf": [
        Claim("llama.cpp", "GGUF: key-value metadata then aligned tensor data, memory-mappable",
              "ggml-org/ggml: docs/gguf.md"),
        Claim("llama.cpp", "Q4_0: blocks of 32 weights, 4-bit codes plus one fp16 scale; "
              "k-quants use 256-weight super-blocks with quantized sub-block scales",
              LLAMA_CPP + "ggml/src/ggml-common.h (block_q4_0, QK4_0 = 32; block_q4_K, "
              "QK_K = 256)"),
    ],
    "llama-cpp-offload": [
        Claim("llama.cpp", "n_gpu_layers (-ngl) layers go to the GPU, the rest run on the CPU; "
              "the model file is memory-mapped by default (use_mmap)",
              LLAMA_CPP + "common/arg.cpp (--n-gpu-layers, --no-mmap); include/llama.h "
              "(llama_model_params)"),
        Claim("llama.cpp", "--fit (default on) adjusts the arguments the user left unset (GPU "
              "layers, context size) to the free device memory; -ngl takes N, auto (default) "
              "or all", LLAMA_CPP + "common/arg.cpp (-fit, --fit-target, --fit-ctx, "
              "--n-gpu-layers); https://github.com/ggml-org/llama.cpp/pull/16653"),
        Claim("llama.cpp", "-ot/--override-tensor pattern=buffer places single tensors; "
              "--n-cpu-moe N / --cpu-moe keep the MoE expert weights of the first N (or all) "
              "layers on the CPU", LLAMA_CPP + "common/arg.cpp (--override-tensor, --n-cpu-moe, "
              "--cpu-moe)"),
    ],
    "cuda-graphs": [
        Claim("vLLM", "cudagraph_mode FULL_AND_PIECEWISE (the V1 default) captures uniform "
              "decode batches as full CUDA graphs and other batches piecewise around attention; "
              "cudagraph_capture_sizes pads a batch up to the next captured size",
              VLLM + "docs/design/cuda_graphs.md; vllm/config/compilation.py (CUDAGraphMode, "
              "cudagraph_capture_sizes)"),
    ],
    "attention-op": [
        Claim("vLLM", "attention is registered as a custom op, unified_attention, with a fake "
              "implementation, so torch.compile treats it as one node (the split point of the "
              "piecewise graphs)", VLLM + "vllm/attention/layer.py (direct_register_custom_op "
              "op_name=\"unified_attention\"); docs/design/torch_compile.md"),
    ],
    "overlap-scheduling": [
        Claim("SGLang", "the v0.4 zero-overhead batch scheduler runs one batch ahead, preparing "
              "the next batch's metadata while the GPU computes, with future tokens resolving "
              "the dependency on the running batch's output",
              "https://lmsys.org/blog/2024-12-04-sglang-v0-4/#zero-overhead-batch-scheduler"),
        Claim("TensorRT-LLM", "the overlap scheduler launches step n+1's GPU work before step n's "
              "CPU tasks (stop criteria, responses, scheduling) finish, at the price of one "
              "extra decoding step; on by default (disable_overlap_scheduler)",
              TRTLLM_DOCS + "latest/features/overlap-scheduler.html"),
        Claim("vLLM", "async scheduling (--async-scheduling) schedules the next step before the "
              "running one's tokens are back, counting each running request's pending token as "
              "an output placeholder", VLLM + "vllm/v1/core/sched/async_scheduler.py "
              "(AsyncScheduler, num_output_placeholders)"),
    ],
    "trtllm": [
        Claim("TensorRT-LLM", "in the 1.x releases tensorrt_llm.LLM runs the PyTorch backend (the "
              "engine path moved to tensorrt_llm._tensorrt_engine) and needs no engine build",
              TRTLLM_DOCS + "1.1.0rc3/torch.html"),
        Claim("TensorRT-LLM", "the TensorRT engine backend was later removed; checkpoints load "
              "directly", TRTLLM_DOCS + "legacy/tensorrt-backend-removal.html"),
        Claim("PyTorch", "that default backend runs the models as PyTorch modules with "
              "TensorRT-LLM's custom kernels", TRTLLM_DOCS + "torch.html"),
        Claim("TensorRT-LLM", "in-flight batching and a paged, reusable KV cache",
              TRTLLM_DOCS + "features/paged-attention-ifb-scheduler.html"),
        Claim("TensorRT-LLM", "FP4 (NVFP4) GEMMs need Blackwell tensor cores",
              TRTLLM_DOCS + "features/quantization.html"),
    ],
    "frameworks": [
        Claim("Transformers", "the default DynamicCache grows by torch.cat each step; "
              "StaticCache pre-allocates max_cache_len for torch.compile",
              TRANSFORMERS + "src/transformers/cache_utils.py (DynamicLayer.update, "
              "StaticLayer)"),
        Claim("Transformers", "generate runs a padded batch until every sequence stops",
              TRANSFORMERS + "src/transformers/generation/utils.py (unfinished_sequences)"),
        Claim("Transformers", "generate_batch: continuous batching with a paged cache",
              TRANSFORMERS + "src/transformers/generation/continuous_batching/continuous_api.py; "
              "continuous_batching/cache.py (PagedAttentionCache)"),
        Claim("vLLM", "paged KV cache, continuous batching, prefix caching", PAGED_PAPER),
        Claim("TensorRT-LLM", "NVIDIA's tuned kernels and in-flight batching",
              TRTLLM_DOCS + "overview.html"),
        Claim("SGLang", "RadixAttention for prefix reuse; a frontend language for structured "
              "generation programs", "https://arxiv.org/abs/2312.07104 (Zheng et al., SGLang)"),
        Claim("llama.cpp", "C/C++ inference on CPUs, Apple silicon and many GPUs",
              LLAMA_CPP + "README.md"),
        Claim("Ollama", "runs GGUF models on laptops and desktops through llama.cpp's ggml",
              "https://github.com/ollama/ollama (README)"),
    ],
    "moe": [
        Claim("Mixtral", "8 experts, top-2 routing, 32 layers, hidden 4096, FFN 14336, 8 KV heads",
              "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1 (config.json); "
              "https://arxiv.org/abs/2401.04088"),
    ],
    "sse": [
        Claim("vLLM", "the OpenAI-compatible server streams 'data: {json}' events and ends with "
              "'data: [DONE]'", VLLM + "vllm/entrypoints/openai/serving_chat.py "
              "(chat_completion_stream_generator)"),
        Claim("vLLM", "a client disconnect cancels the handler, which aborts the request",
              VLLM + "vllm/entrypoints/utils.py (with_cancellation, listen_for_disconnect); "
              "vllm/v1/engine/async_llm.py (generate: abort on CancelledError)"),
    ],
    "mig": [
        Claim("MIG", "A100, H100/H200 and Blackwell B200/GB200/B300 split into up to 7 isolated "
              "instances; A100-80GB profiles 1g.10gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb; B200 "
              "(180 GB) profiles 1g.23gb, 1g.45gb, 2g.45gb, 3g.90gb, 4g.90gb, 7g.180gb",
              MIG_GUIDE + "supported-gpus.html; " + MIG_GUIDE + "supported-mig-profiles.html; "
              "https://www.nvidia.com/en-us/data-center/hgx/ (B300: up to 7 MIG instances)"),
        Claim("MPS", "kernels from several processes run concurrently, limited isolation",
              "https://docs.nvidia.com/deploy/mps/"),
    ],
    "monitoring": [
        Claim("Prometheus", "vLLM and TGI expose TTFT, TPOT, queue, KV usage and preemption "
              "metrics on /metrics in Prometheus format (TGI is in maintenance mode since "
              "December 2025: new deployments use vLLM or SGLang)",
              "https://docs.vllm.ai/en/latest/usage/metrics.html; " + TGI
              + "router/src/server.rs (/metrics); " + TGI_MAINTENANCE),
    ],
    "tp-split": [
        Claim("Megatron", "column-parallel then row-parallel linears: one all-reduce after "
              "attention and one after the MLP",
              "NVIDIA/Megatron-LM: megatron/core/tensor_parallel/layers.py "
              "(ColumnParallelLinear, RowParallelLinear); https://arxiv.org/abs/1909.08053"),
    ],
    "tp-vs-pp": [
        Claim("vLLM", "pipeline stages pass hidden_states and residual between ranks",
              VLLM + "vllm/model_executor/models/llama.py (LlamaModel.forward returns "
              "IntermediateTensors)"),
        Claim("vLLM", "tensor parallel within a node, pipeline parallel across nodes",
              "https://docs.vllm.ai/en/v0.8.3/serving/distributed_serving.html"),
    ],
    "safetensors-mmap": [
        Claim("safetensors", "8-byte little-endian header size, JSON header with dtype, shape "
              "and data_offsets, then the raw bytes; get_slice reads part of a tensor",
              "huggingface/safetensors: README.md (Format); docs/source/index.mdx"),
        Claim("PyTorch", "torch.load defaults to weights_only=True since 2.6",
              "https://pytorch.org/docs/stable/generated/torch.load.html; "
              "pytorch/pytorch: torch/serialization.py (_default_to_weights_only)"),
        Claim("llama.cpp", "computes from the memory-mapped GGUF on CPU",
              LLAMA_CPP + "src/llama-mmap.cpp; src/llama-model-loader.cpp"),
    ],
    "cold-start": [
        Claim("S3", "about 85-90 MB/s per connection; parallel byte-range GETs of 8-16 MB",
              "https://docs.aws.amazon.com/AmazonS3/latest/userguide/"
              "optimizing-performance-guidelines.html"),
    ],
    "hot-update": [
        Claim("Kubernetes", "terminationGracePeriodSeconds defaults to 30 s; preStop hooks run "
              "before SIGTERM", "https://kubernetes.io/docs/concepts/workloads/pods/"
              "pod-lifecycle/#pod-termination"),
        Claim("Triton Inference Server", "explicit model control loads a new version beside the "
              "serving one", "triton-inference-server/server: docs/user_guide/"
              "model_management.md"),
        Claim("vLLM", "reset_prefix_cache invalidates the prefix cache after a weight update "
              "(RLHF flows)", VLLM + "vllm/v1/core/kv_cache_manager.py (reset_prefix_cache); "
              "vllm/entrypoints/llm.py (LLM.reset_prefix_cache)"),
    ],
    "tenants": [
        Claim("MIG", "hardware-isolated GPU instances for strict tenant isolation", MIG_GUIDE),
        Claim("vLLM", "cache_salt in a request keeps its prefix-cache keys apart from other "
              "tenants'", VLLM + "vllm/v1/core/kv_cache_utils.py (cache_salt in the first "
              "block's extra keys)"),
    ],
    "lora-batching": [
        Claim("Punica", "SGMV: one kernel applies a different LoRA per batch segment",
              "https://arxiv.org/abs/2310.18547; punica-ai/punica"),
        Claim("vLLM", "LoRA shrink/expand kernels derived from Punica; max_loras, max_lora_rank, "
              "max_cpu_loras", VLLM + "vllm/lora/punica_wrapper/; vllm/lora/ops/triton_ops/ "
              "(lora_shrink, lora_expand); vllm/config/lora.py"),
        Claim("S-LoRA", "unified paging of adapter weights and KV cache in one GPU pool",
              "https://arxiv.org/abs/2311.03285; S-LoRA/S-LoRA"),
    ],
    "qlora-deploy": [
        Claim("QLoRA", "adapters are trained against the dequantized NF4 base", QLORA_PAPER),
        Claim("bitsandbytes", "4-bit NF4 kernels used to serve the base unmerged", BNB_4BIT),
        Claim("vLLM", "LoRA on a bitsandbytes 4-bit base (QLoRA) at inference",
              VLLM + "examples/offline_inference/lora_with_quantization_inference.py; "
              "https://docs.vllm.ai/en/latest/features/quantization/bnb.html"),
    ],
    "on-device": [
        Claim("llama.cpp", "k-quant mixes such as Q4_K_M store output.weight as Q6_K",
              LLAMA_CPP + "src/llama-quant.cpp (llama_tensor_get_type)"),
    ],
    "safety-review": [
        Claim("Llama Guard", "Llama Guard 3 1B is fine-tuned from Llama-3.2-1B; the 8B from "
              "Llama-3.1-8B", "https://huggingface.co/meta-llama/Llama-Guard-3-1B; "
              "https://huggingface.co/meta-llama/Llama-Guard-3-8B"),
    ],
}
