"""LLM: the offline batch API (vLLM's ``LLM``): give prompts, get RequestOutputs in input order.

    llm = labkit.LLM(model="labkit-tiny")
    outs = llm.generate(["def fib(n):"], labkit.SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

``llm.llm_engine`` is the LLMEngine underneath, for stepping, stats and the trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from labkit.engine.llm_engine import LLMEngine
from labkit.engine.model_setup import step_cures
from labkit.engine.outputs import CompletionOutput, RequestOutput
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import EngineConfigError, InvalidPromptError
from labkit.utils import is_int


class LLM:
    """``LLM(model, **engine_settings)``: ``model`` is a shipped name, a checkpoint folder, a
    model object or a ``(model, tokenizer)`` pair; the settings are :class:`EngineConfig`'s flat
    fields (``block_size``, ``max_num_seqs``, ``enable_prefix_caching``, ``policy``,
    ``kv_cache_dtype``, ``attention_backend``, ``speculative_config``, ...), checked once there.
    ``dtype`` ("auto" | "float32" | "bfloat16" | "float16") and ``device`` place the model.
    ``profile=True`` times each step's phases (``llm.profiler``, ``labkit.engine.profiler``).
    ``fused=True`` fuses q|k|v, gate|up, the residual adds into the norms and the rotary
    table (``labkit.model.fuse.fuse_model``); ``compile=True`` compiles the forward piecewise
    around attention (``labkit.engine.piecewise``; ``compile_sizes`` the capture sizes,
    ``llm.compile_report`` what was compiled, in how many seconds, or why not), and runs a
    step where every sequence decodes one token as one full graph, attention included
    (``labkit.engine.full_graph``; ``compile_mode="piecewise"`` turns that off), whose kernels
    are called from generated C++ (``compile_wrapper="python"``: from inductor's Python
    wrapper, ``labkit.engine.graph_capture`` says what that costs); on a CUDA device each
    full graph is also captured as a CUDA graph (``cuda_graphs=False``: not;
    ``labkit.engine.cuda_graph``). Both change
    the model object in place, with the same greedy tokens. ``async_scheduling=True`` (vLLM's
    name) schedules each step while the one before it computes (``labkit.engine.overlap``),
    with the same greedy tokens.
    ``enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=8`` serve LoRA adapters
    (``labkit.lora``): ``generate(..., lora_request=LoRARequest(name, int_id, path))``."""

    def __init__(self, model: Any = "labkit-tiny", *, tokenizer: Any = None,
                 device: str | torch.device | None = None, dtype: Any = None,
                 profile: bool = False, fused: bool = False, compile: bool = False,
                 compile_sizes: tuple[int, ...] | None = None,
                 compile_mode: str = "full_and_piecewise", compile_wrapper: str = "cpp",
                 cuda_graphs: bool = True, **engine_settings: Any) -> None:
        name = ""
        dtype = _torch_dtype(dtype)
        if isinstance(model, (tuple, list)):
            model, tokenizer = model
        elif not isinstance(model, torch.nn.Module):
            from labkit.model.loader import has_tokenizer, load_pretrained, open_checkpoint

            name = str(model)
            # vLLM's flag; a folder without tokenizer.json (transformers' model.save_pretrained
            # alone) runs on prompt_token_ids, and a text prompt is then a named error
            skip = engine_settings.pop("skip_tokenizer_init", False) or not has_tokenizer(model)
            if (engine_settings.get("tensor_parallel_size", 1) != 1 or  # ranks read slices
                    engine_settings.get("distributed_executor_backend") is not None):
                model, tok = open_checkpoint(model, dtype, device, skip_tokenizer_init=skip)
            else:
                model, tok = load_pretrained(model, dtype=dtype, device=device,
                                             skip_tokenizer_init=skip)
            tokenizer = tokenizer or tok
        if isinstance(model, torch.nn.Module):
            if device is not None or dtype is not None:
                model = model.to(device=device, dtype=dtype)
            model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.compile_report = step_cures(model, engine_settings, fused, compile, compile_sizes,
                                         compile_mode, compile_wrapper, cuda_graphs)
        self.llm_engine = LLMEngine.from_model(model, tokenizer, name=name, **engine_settings)
        self._counter = 0
        self.profiler = None  # profile=True: a StepProfiler timing every step's phases
        if profile:
            from labkit.engine.profiler import StepProfiler

            self.profiler = StepProfiler().attach(self.llm_engine)

    @classmethod
    def from_model(cls, model: torch.nn.Module, tokenizer: Any = None, **kw: Any) -> LLM:
        return cls((model, tokenizer), **kw)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``LLM.reset_prefix_cache()``: True once every cached prefix is forgotten;
        False (nothing changed) while requests hold blocks
        (:meth:`LLMEngine.reset_prefix_cache`)."""
        return self.llm_engine.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop worker processes (tensor parallelism); they also stop when the LLM is garbage
        collected or the interpreter exits."""
        self.llm_engine.executor.shutdown()
        if self.llm_engine.step_loop is not None:  # async scheduling's host thread
            self.llm_engine.step_loop.shutdown()

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, prompt_token_ids: Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = False, priority: Sequence[int] | None = None,
                 cache_salt: str | None = None, lora_request: Any = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. ``lora_request``
        (vLLM's): None (the base model), one ``LoRARequest`` for every prompt, or a list with
        one per prompt (None = the base model for that prompt); one step mixes them."""
        items = _prompt_items(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(items))
        if len(params) != len(items):
            raise InvalidPromptError(f"{len(params)} sampling params for {len(items)} prompts")
        if priority is not None and len(priority) != len(items):
            raise InvalidPromptError(f"{len(priority)} priorities for {len(items)} prompts")
        loras = (list(lora_request) if isinstance(lora_request, (list, tuple))
                 else [lora_request] * len(items))
        if len(loras) != len(items):
            raise InvalidPromptError(f"{len(loras)} lora requests for {len(items)} prompts")
        ids = self._add_all(items, params, priority, cache_salt, loras)
        self._run(ids, use_tqdm)
        return [self.request_output(rid, items[i] if isinstance(items[i], str) else None)
                for i, rid in enumerate(ids)]

    def _add_all(self, items: list[Any], params: list[SamplingParams],
                 priority: Sequence[int] | None, cache_salt: str | None,
                 loras: list[Any]) -> list[str]:
        eng, ids = self.llm_engine, []
        try:
            for i, (p, sp) in enumerate(zip(items, params)):
                rid = f"gen-{self._counter}"
                self._counter += 1
                eng.add_request(rid, p, sp, priority=priority[i] if priority else 0,
                                cache_salt=cache_salt, lora_request=loras[i])
                ids.append(rid)
        except BaseException:  # bad input, a tokenizer error, Ctrl-C: queue nothing
            for rid in ids:
                eng.abort(rid)
            raise
        return ids

    def _run(self, ids: list[str], use_tqdm: bool) -> None:
        eng = self.llm_engine
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        pending = set(ids)
        try:
            while eng.has_unfinished_requests():
                for o in eng.step():
                    if o.finished and eng.requests[o.request_id].is_finished and \
                            o.request_id in pending:
                        pending.discard(o.request_id)
                        bar.update(1)
        except BaseException:
            # an interrupt (Ctrl-C in a notebook) or a failed step: abort this call's other
            # requests too, so no blocks stay held and the next generate() starts clean
            eng.abort(ids)
            raise
        finally:
            bar.close()

    def request_output(self, request_id: str, prompt: str | None = None) -> RequestOutput:
        return make_request_output(self.llm_engine, request_id, prompt)


def _prompt_items(prompts: Any, prompt_token_ids: Any) -> list[Any]:
    """Text prompts, or token-id prompts (a [B, T] tensor / array, a list of lists, or one
    flat list), as one list with an item per request."""
    if prompt_token_ids is not None:
        if prompts is not None:
            raise InvalidPromptError("give prompts or prompt_token_ids, not both")
        if hasattr(prompt_token_ids, "tolist"):  # a tensor / array of [B, T] ids
            prompt_token_ids = prompt_token_ids.tolist()
        items: list[Any] = list(prompt_token_ids)
        if items and all(is_int(t) for t in items):
            items = [items]  # one prompt as a flat list of ids (vLLM accepts it too)
        return items
    if isinstance(prompts, str):
        return [prompts]
    if prompts is None:
        raise InvalidPromptError("give prompts or prompt_token_ids")
    items = list(prompts)
    if any(is_int(p) for p in items):
        raise InvalidPromptError("prompts are strings (or lists of token ids); pass "
                                 "token ids as prompt_token_ids=[[...], ...]")
    return items


def make_request_output(engine: LLMEngine, request_id: str,
                        prompt: str | None = None) -> RequestOutput:
    req = engine.requests[request_id]
    tok = engine.tokenizer
    outs = []
    for s in req.seqs:
        text = s.output_text  # kept current by the engine, stop strings already cut
        if not text and tok is not None and s.output_token_ids and req.params.detokenize \
                and not req.params.stop:  # '' after a stop-string cut is the answer
            text = tok.decode(s.output_token_ids)
        lps = None if s.logprobs is None else list(s.logprobs)
        outs.append(CompletionOutput(s.index, text, list(s.output_token_ids), s.finish_reason,
                                     lps))
    plps = None if req.prompt_logprobs is None else list(req.prompt_logprobs)
    return RequestOutput(request_id, prompt, list(req.prompt_token_ids), outs, req.is_finished,
                         req.seqs[0].num_cached_tokens, prompt_logprobs=plps)


def _torch_dtype(dtype: Any) -> torch.dtype | None:
    """"auto" (vLLM's default: keep the checkpoint's / model's dtype) -> None; a name -> torch's
    dtype (a string used to be silently ignored for a model object)."""
    if dtype == "auto" or dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in ("float32", "bfloat16", "float16"):
            raise EngineConfigError(f"dtype must be 'auto', float32, bfloat16 or float16, "
                                    f"got {dtype!r}")
        return getattr(torch, dtype)
    return dtype
