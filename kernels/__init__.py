"""Triton kernels for labkit, importable as ``labkit.kernels``.

One kernel per file, each with a plain-PyTorch reference beside it (``*_ref``) and a docstring
with its tiling, what bounds it and its arithmetic intensity:

- ``paged_attention``: decode attention over a paged KV cache, split-KV (flash-decoding) merge;
- ``paged_prefill``: causal varlen attention of new tokens over their cached blocks;
- ``reshape_and_cache``: scatter new K/V into their slots (quantizing for an INT8 cache);
- ``int8_kv``: the INT8 KV cache pieces those three share (quantize on write, scale on read),
  and ``fp8_kv`` the FP8 (e4m3) ones (its bits encoded and decoded by hand);
- ``paged_checks``: the paged kernels' input checks and their references' small pieces;
- ``rms_norm`` (optional fused residual add), ``rotary_embedding`` (in place);
- ``dequant_matmul``: W4A16 GPTQ / AWQ and W8A16 matmuls on the tensor cores, dispatching
  M = 1 to ``dequant_gemv`` (the decode GEMVs); ``nf4``: NF4 dequantisation (its table,
  ``nf4_code``, is the one labkit.quant reads too);
- ``fused_moe``: a mixture-of-experts layer's experts as two grouped GEMMs over (token, k)
  pairs sorted and padded by expert (``moe_align_block_size``), as vLLM's ``fused_moe``;
- ``lora_ops``: multi-LoRA shrink/expand for rows of different adapters, Punica's BGMV (decode,
  a slot per token) and SGMV (prefill, a slot per segment), ``add_lora``;
- ``paged_decode_cpu``: the one kernel here not in Triton: decode attention over a paged float32
  cache in C++ (ATen's vectors), built through inductor's code cache and called as an op from
  the engine's compiled decode graphs on a CPU (``labkit.engine.full_graph``);
- ``backend``: ``TritonBackend``, the engine's attention backend built from the above;
- ``selfcheck`` (each kernel vs its reference) and ``timing`` (device time without launch
  overhead or a warm L2), used by ``labkit bench kernels``.

On a machine without a GPU set ``TRITON_INTERPRET=1`` before importing triton and the kernels run
on CPU tensors (slowly; the tests do this).
"""
