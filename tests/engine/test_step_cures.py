"""``LLM(fused=True)`` and ``LLM(compile=True)`` (issue 31's cures of a step's overhead): the
same greedy tokens as ``labkit.model.generate`` and the plain engine, several prompts at once
with chunked prefill; a compile that cannot run says why instead of failing or hiding it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

import labkit
from labkit.engine import full_graph, packed_linear, piecewise
from labkit.engine.compile_view import capture_output_code
from labkit.engine.dot_linear import dot_linear, use_dot_products
from labkit.errors import EngineConfigError
from labkit.model import testing
from labkit.model.fuse import fuse_model, is_fused
from labkit.model.generate import generate
from labkit.model.llama import rope_cos_sin

SP = labkit.SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           architecture="MixtralForCausalLM")
CHUNKED = dict(block_size=4, max_num_batched_tokens=8)  # prompts > 8 tokens prefill in chunks


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 13, 1, 9)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_fused_model_is_the_same_function_bit_for_bit():
    model = testing.tiny_model(seed=4)
    ref = copy.deepcopy(model)
    applied = fuse_model(model)
    assert applied == {"projections": 4, "add_norm": True, "rope_table": True}
    assert fuse_model(model) == {"projections": 0, "add_norm": False, "rope_table": False}
    assert is_fused(model) and list(model.state_dict()) == list(ref.state_dict())
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(0))
    seen = {}  # a hook on the final norm (EAGLE's feature capture) sees the hidden state
    for name, m in (("ref", ref), ("fused", model)):
        m.model.norm.register_forward_hook(lambda _m, a, _o, n=name: seen.setdefault(n, a[0]))
    with torch.no_grad():
        got, want = model(ids), ref(ids)
    # the same additions in the same order and the same norm arithmetic: exactly equal
    assert torch.equal(got, want) and torch.equal(seen["fused"], seen["ref"])
    pos = torch.tensor([[0, 7, 255]])
    for a, b in zip(model.rope(pos, torch.float32), rope_cos_sin(pos, 16, 10000.0,
                                                                 torch.float32)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="beyond the model's context"):
        model(torch.tensor([[1]]), torch.tensor([[256]]))


def test_fused_engine_equals_generate_and_the_plain_engine():
    model = testing.tiny_model(seed=5)
    prompts = _prompts()
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    plain = labkit.LLM.from_model(copy.deepcopy(model), None, **CHUNKED)
    fused = labkit.LLM.from_model(model, None, fused=True, **CHUNKED)
    assert is_fused(fused.model) and fused.compile_report is None
    assert _tokens(plain.generate(prompt_token_ids=prompts, sampling_params=SP)) == want
    assert _tokens(fused.generate(prompt_token_ids=prompts, sampling_params=SP)) == want
    # the fused model object itself still runs labkit.model.generate, with the same tokens
    assert [generate(model, p, 10, ignore_eos=True) for p in prompts] == want


def test_fused_moe_skips_its_experts_and_keeps_its_tokens():
    model = testing.tiny_model(seed=6, **MOE)
    prompts = _prompts()[:2]
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    llm = labkit.LLM.from_model(model, None, fused=True, **CHUNKED)
    # q|k|v fused in both layers, no dense gate|up to fuse; the norms and rope apply as usual
    assert not hasattr(model.model.layers[0].mlp, "gate_up_proj")
    assert hasattr(model.model.layers[0].self_attn, "qkv_proj")
    assert "forward" in vars(model.model) and "rope" in vars(model)
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP)) == want


def test_cures_refuse_tensor_parallel_and_compile_refuses_lora():
    with pytest.raises(EngineConfigError, match="tensor-parallel"):
        labkit.LLM.from_model(testing.tiny_model(), None, fused=True, tensor_parallel_size=2)
    with pytest.raises(EngineConfigError, match="enable_lora"):
        labkit.LLM.from_model(testing.tiny_model(), None, compile=True, enable_lora=True)


def test_without_a_compiler_compile_names_the_reason_and_runs_eager(monkeypatch):
    monkeypatch.setattr(piecewise, "cxx_compiler", lambda: None)
    model = testing.tiny_model(seed=7)
    prompts = _prompts()[:2]
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        llm = labkit.LLM.from_model(model, None, compile=True, **CHUNKED)
    rep = llm.compile_report
    assert not rep.compiled and "C++ compiler" in rep.reason and "not compiled" in str(rep)
    assert "forward" not in vars(model)  # nothing installed: the model's own forward runs
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP)) == want


def test_a_first_compile_that_fails_falls_back_with_its_error_named():
    def broken_backend(gm, example_inputs):
        raise RuntimeError("no kernels today")

    model = testing.tiny_model(seed=8)
    prompts = _prompts()[:2]
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    rep = piecewise.compile_model(model, capture_sizes=(8,), backend=broken_backend)
    assert rep.compiled and rep.reason is None
    llm = labkit.LLM.from_model(model, None, **CHUNKED)
    with pytest.warns(RuntimeWarning, match="first compile failed"):
        got = _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP))
    assert got == want
    assert not rep.compiled and "no kernels today" in rep.reason and rep.compile_s == {}


def test_moe_models_are_not_compiled_and_say_why():
    model = testing.tiny_model(**MOE)
    with pytest.warns(RuntimeWarning, match="mixture-of-experts"):
        rep = piecewise.compile_model(model)
    assert not rep.compiled and "mixture-of-experts" in rep.reason


def test_bad_capture_sizes_are_refused():
    with pytest.raises(ValueError, match="capture sizes"):
        piecewise.compile_model(testing.tiny_model(), capture_sizes=(0, 4))
    with pytest.raises(ValueError, match="dot_max_tokens"):
        piecewise.compile_model(testing.tiny_model(), dot_max_tokens=-1)
    with pytest.raises(ValueError, match="backend must be"):
        piecewise.compile_model(testing.tiny_model(), backend="tensorrt")


@pytest.mark.slow
def test_compiled_fused_engine_equals_generate_with_padding_and_eager_steps():
    """Two capture sizes (1, 4): a decode step of one sequence runs the 1-token graphs (whose
    linears are dot-product loops), steps of 2 to 4 sequences are padded up to 4, prefill
    chunks of 8 tokens run eager; greedy tokens equal generate's either way. (~40 s: inductor
    builds the graphs with the machine's C++ compiler.)"""
    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: the fallback test above covers this machine")
    model = testing.tiny_model(seed=9)
    prompts = _prompts()
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    with warnings.catch_warnings(), capture_output_code() as codes:
        warnings.simplefilter("error", RuntimeWarning)  # no fallback may happen here
        # the step profiler's module hooks come and go every step: no graph may depend on them
        llm = labkit.LLM.from_model(model, None, fused=True, compile=True,
                                    compile_sizes=(1, 4), compile_mode="piecewise",
                                    profile=True, **CHUNKED)
        got = _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP))
        first = llm.compile_report.graphs
        again = _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP))
    rep = llm.compile_report
    assert rep.compiled and rep.reason is None, rep
    assert sorted(rep.compile_s) == [1, 4] and min(rep.compile_s.values()) > 0
    assert rep.eager_forwards > 0  # the 8-token prefill chunks
    assert got == again == want
    # one graph per piece and size serves every layer and every step (the pieces before,
    # between and after the attention calls, the dot-product LM head of a 1-row step)
    pieces = {(k, n) for k in ("pre", "between", "last") for n in (1, 4)} | {("head", 1)}
    assert set(model.forward.graphs) == pieces and rep.graphs == first == len(pieces)
    # inductor's code: library matmuls at 4 tokens (oneDNN's, over the packed weights, where
    # torch has oneDNN), none at 1 (the dot-product loops)
    gemm = "mkldnn._linear_pointwise" if rep.packed_bytes else "mm"
    assert any(gemm in c.library_calls for c in codes)
    assert sum(not c.library_calls for c in codes) >= 4  # pre, between, last, head at 1
    assert llm.profiler.summary()["phases_s"]["forward"] > 0
    # the compiled model object also runs labkit.model.generate (its contiguous cache)
    assert [generate(model, p, 10, ignore_eos=True) for p in prompts] == want


def test_uniform_decode_steps_run_as_full_graphs_with_the_same_tokens():
    """compile_mode="full_and_piecewise" (the default): a step where every sequence decodes
    one token runs as one graph, attention and the KV writes inside, per (capture size, block
    bucket); 1 to 4 sequences (3 padded to 4 with copies of the first row), contexts in two
    buckets; steps with a prefill chunk run piecewise. Greedy tokens equal generate's."""
    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    model = testing.tiny_model(seed=9)
    prompts = _prompts()
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback may happen here
        llm = labkit.LLM.from_model(model, None, fused=True, compile=True,
                                    compile_sizes=(1, 4), **CHUNKED)
        got = _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP))
        one = _tokens(llm.generate(prompt_token_ids=prompts[1:2], sampling_params=SP))
    rep = llm.compile_report
    assert got == want and one == want[1:2]
    assert rep.full_graphs and rep.full_reason is None and rep.full_steps > 0, rep
    full = {(k.split("/")[0], n) for k, n in model.forward.graphs if k.startswith("full")}
    # blocks of 4 tokens: contexts of up to 16 tokens in bucket 4, up to 23 in bucket 8
    assert full == {("full4", 1), ("full8", 1), ("full4", 4), ("full8", 4)}, full
    assert "decode steps as full graphs" in str(rep)


@pytest.mark.parametrize("min_keys", [0, 10**6])
def test_full_graph_attention_is_the_cpp_kernel_or_inductors_loops_and_says_which(
        min_keys, monkeypatch):
    """Attention in a full graph is the C++ decode op when the step is big enough
    (``KERNEL_MIN_KEYS``, here forced both ways) and the heads allow it (float32, head_dim a
    multiple of 16); otherwise inductor's loops over the bucket (head_dim 8 always). Every
    path gives generate's greedy tokens; the generated code calls the op exactly when the
    report says so."""
    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    monkeypatch.setattr(full_graph, "KERNEL_MIN_KEYS", min_keys)
    prompts = _prompts()[:2]
    for head_dim in (16, 8):
        model = testing.tiny_model(seed=5, head_dim=head_dim)
        want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
        with capture_output_code() as codes:
            llm = labkit.LLM.from_model(model, None, compile=True, compile_sizes=(2,),
                                        **CHUNKED)
            got = _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP))
        assert got == want
        rep = llm.compile_report
        kernel = head_dim == 16 and min_keys == 0
        assert rep.full_steps > 0 and rep.full_attention, rep
        assert all((a == full_graph.KERNEL) == kernel for a in rep.full_attention.values()), rep
        calls = any("torch.ops.labkit.paged_decode_cpu" in c.source for c in codes)
        assert calls == kernel
        assert f"kernel in {len(rep.full_attention) if kernel else 0} of" in str(rep)
        if head_dim == 8:
            assert all("multiple of 16" in a for a in rep.full_attention.values())


@pytest.mark.parametrize("min_keys", [0, 10**6])  # the C++ kernel's window, the loops' mask
def test_a_full_graph_masks_a_sliding_window_over_freed_blocks(min_keys, monkeypatch):
    """Mistral's window (every layer sees its last 6 keys; blocks behind the window are freed
    and read as block 0): the full graph leaves them out, as the torch backend does."""
    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    monkeypatch.setattr(full_graph, "KERNEL_MIN_KEYS", min_keys)
    model = testing.tiny_model(seed=4, sliding_window=6, architecture="MistralForCausalLM")
    prompt = _prompts()[1]
    want = generate(model, prompt, 12, ignore_eos=True)
    llm = labkit.LLM.from_model(model, None, compile=True, compile_sizes=(1,), **CHUNKED)
    sp = labkit.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert _tokens(llm.generate(prompt_token_ids=[prompt], sampling_params=sp)) == [want]
    assert llm.compile_report.full_steps > 0, llm.compile_report


def _spy_backend(seen: list, fail_cpp_wrapper: bool = False):
    """A backend that runs the traced graph as it is and records, per compile, the thread
    and the inductor settings in force there (``cpp_wrapper``, ``cpp.simdlen``)."""
    import threading

    from torch._inductor import config

    def backend(gm, example_inputs):
        seen.append((threading.current_thread().name, config.cpp_wrapper, config.cpp.simdlen))
        if fail_cpp_wrapper and config.cpp_wrapper:
            raise RuntimeError("no C++ wrapper today")
        return gm
    return backend


def test_inductor_settings_reach_a_compile_on_another_thread(monkeypatch):
    """torch keeps inductor's settings per thread, and a graph compiles on whichever thread
    runs its first forward (a server's engine thread, not the one that built the LLM): each
    compile gets its settings from the model's PiecewiseForward (the C++ wrapper for full
    graphs only, $ATEN_CPU_CAPABILITY's width)."""
    import threading

    from torch._inductor import config

    seen_there = []
    with config.patch({"cpp_wrapper": True}):  # why: a setting made here ...
        t = threading.Thread(target=lambda: seen_there.append(config.cpp_wrapper))
        t.start()
        t.join()
    assert seen_there == [False]  # ... is not seen on another thread
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    model = testing.tiny_model(seed=6)
    prompts = _prompts()[:2]
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    seen: list = []
    with config.patch({"cpp.simdlen": None}):
        piecewise.compile_model(model, capture_sizes=(2,), backend=_spy_backend(seen))
    llm = labkit.LLM.from_model(model, None, **CHUNKED)
    got: list = []
    t = threading.Thread(name="engine-thread", target=lambda: got.append(
        _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP))))
    t.start()
    t.join()
    assert got == [want]
    kinds = [k for k, _ in model.forward.graphs]  # in build order, as seen
    assert len(seen) == len(kinds) and any(k.startswith("full") for k in kinds), kinds
    for kind, (thread, cpp_wrapper, simdlen) in zip(kinds, seen):
        assert thread == "engine-thread" and simdlen == 256
        assert cpp_wrapper == kind.startswith("full"), (kind, cpp_wrapper)


def test_the_pinned_vector_width_travels_to_other_threads(monkeypatch):
    """compile_model pins the width on its own thread first (match_aten_vector_width), then
    fixes the options its graphs compile with: the pinned width must be among them, or a graph
    compiled on another thread would build with the CPU's own."""
    from torch._inductor import config

    from labkit.engine.graph_capture import inductor_options

    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    with config.patch({"cpp.simdlen": None}):
        assert piecewise.match_aten_vector_width() == 256
        assert inductor_options()["cpp.simdlen"] == 256
    with config.patch({"cpp.simdlen": 512}):  # the user's own choice travels too
        assert inductor_options(cpp_wrapper=True) == {"cpp_wrapper": True, "cpp.simdlen": 512}
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    with config.patch({"cpp.simdlen": None}):
        assert inductor_options() == {"cpp_wrapper": False}


def test_a_cpp_wrapper_that_cannot_be_built_falls_back_and_says_why():
    model = testing.tiny_model(seed=6)
    prompts = _prompts()[:2]
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    seen: list = []
    rep = piecewise.compile_model(model, capture_sizes=(2,),
                                  backend=_spy_backend(seen, fail_cpp_wrapper=True))
    llm = labkit.LLM.from_model(model, None, **CHUNKED)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ wrapper failed"):
        got = _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP))
    assert got == want and rep.compiled and rep.full_steps > 0
    assert "no C++ wrapper today" in rep.wrapper_reason and "C++ wrapper failed" in str(rep)
    assert [w for _, w, _ in seen].count(True) == 1  # tried once, then Python for the rest


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["cpp", "python"])
def test_full_graphs_call_their_kernels_from_the_wrapper_asked(wrapper):
    """``compile_wrapper``: "cpp" builds each full graph's kernel calls as one C++ function
    that releases the GIL; "python" as inductor's Python module. Same greedy tokens."""
    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    model = testing.tiny_model(seed=5)
    prompts = _prompts()[:2]
    want = [generate(model, p, 10, ignore_eos=True) for p in prompts]
    with capture_output_code() as codes:
        llm = labkit.LLM.from_model(model, None, compile=True, compile_sizes=(2,),
                                    compile_wrapper=wrapper, **CHUNKED)
        got = _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=SP))
    rep = llm.compile_report
    assert got == want and rep.full_steps > 0 and rep.wrapper_reason is None
    assert f"{'C++' if wrapper == 'cpp' else 'Python'} wrapper" in str(rep)
    released = [("gil_scoped_release" in c.source) for c in codes]
    assert any(released) == (wrapper == "cpp"), released
    with pytest.raises(EngineConfigError, match="compile_wrapper must be one of"):
        labkit.LLM.from_model(testing.tiny_model(), None, compile=True, compile_wrapper="rust")


def test_engines_with_other_pools_on_one_compiled_model_get_their_own_graphs():
    """The pool is a graph input of fixed shape: a second engine on the same compiled model
    with a pool of another size builds its own full graphs instead of feeding the first
    engine's graphs a tensor of the wrong shape."""
    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    model = testing.tiny_model(seed=9)
    prompt = _prompts()[0]
    want = generate(model, prompt, 6, ignore_eos=True)
    sp = labkit.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for num_blocks in (32, 48):
        llm = labkit.LLM.from_model(model, None, compile=True, compile_sizes=(1,),
                                    num_blocks=num_blocks, **CHUNKED)
        assert _tokens(llm.generate(prompt_token_ids=[prompt], sampling_params=sp)) == [want]
    assert {k.split("/")[1] for k, _ in model.forward.graphs if k.startswith("full")} == \
        {"32", "48"}


def test_full_graphs_refuse_caches_they_do_not_implement_and_say_why():
    """An int8 KV cache (its scales are written and read outside the graph) and a KV
    connector (its per-layer loads and saves wrap the cache's attend) run piecewise with the
    reason on the report; tokens still equal generate's."""
    from labkit.kv.connector import OffloadingConnector
    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    model = testing.tiny_model(seed=9)
    prompt = _prompts()[0]
    llm = labkit.LLM.from_model(model, None, compile=True, compile_sizes=(1,),
                                kv_cache_dtype="int8", **CHUNKED)
    sp = labkit.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
    rep = llm.compile_report
    assert rep.full_steps == 0 and "quantized" in rep.full_reason, rep
    assert "decode steps piecewise (hybrid groups and quantized" in str(rep)
    conn = OffloadingConnector(cpu_bytes=1 << 20)
    llm = labkit.LLM.from_model(model, None, compile=True, compile_sizes=(1,),
                                kv_connector=conn, **CHUNKED)
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
    assert _tokens(out) == [generate(model, prompt, 4, ignore_eos=True)]
    assert llm.compile_report.full_steps == 0 and "KV connector" in rep.full_reason
    with pytest.raises(EngineConfigError, match="compile_mode must be one of"):
        labkit.LLM.from_model(model, None, compile=True, compile_mode="full")


def test_dot_linear_is_the_linear_layer_and_templates_swap_only_plain_linears():
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((2, 3, 16), (8, 16), (8,)))
    torch.testing.assert_close(dot_linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dot_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-6)
    model = testing.tiny_model(seed=11)
    fuse_model(model)
    layer = copy.deepcopy(model.model.layers[0])
    h = torch.randn(1, 1, model.config.hidden_size, generator=g)
    want = layer.mlp(h), layer.self_attn.project_qkv(h)
    use_dot_products(layer)
    assert type(layer.mlp.down_proj).__name__ == "_DotLinear"
    assert type(layer.mlp.gate_up_proj).__name__ == "_DotFusedProjection"
    assert type(layer.input_layernorm) is type(model.model.layers[0].input_layernorm)
    got = layer.mlp(h), layer.self_attn.project_qkv(h)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(got[1], want[1]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear  # the model untouched


def test_fused_norms_run_the_triton_kernel_with_the_triton_backend(monkeypatch):
    """``attention_backend="triton"`` (the interpreter on a CPU): the add + norm is
    kernels/rms_norm.py's kernel, with generate's greedy tokens; the torch backend on the same
    model object puts the PyTorch norms back."""
    model = testing.tiny_model(seed=10)
    prompts = _prompts()[:2]
    want = [generate(model, p, 6, ignore_eos=True) for p in prompts]
    sp = labkit.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    calls = []
    from labkit.kernels import rms_norm as kernel_module

    real = kernel_module.rms_norm
    monkeypatch.setattr(kernel_module, "rms_norm",
                        lambda *a: calls.append(a[3] is not None) or real(*a))
    llm = labkit.LLM.from_model(model, None, fused=True, attention_backend="triton", **CHUNKED)
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=sp)) == want
    # per forward: layer 0's input norm alone, the 3 other layer norms with a residual, the final
    assert calls and calls[:5] == [False, True, True, True, False]
    labkit.LLM.from_model(model, None, fused=True, **CHUNKED)
    assert "forward" not in vars(model.model.norm)


_ISA_CHECK = """
import torch
from labkit.engine.piecewise import match_aten_vector_width
print(match_aten_vector_width())
f = torch.compile(lambda x, w: torch.nn.functional.rms_norm(x + 1, (64,), w) * 2)
x, w = torch.randn(4, 64), torch.randn(64)
torch.testing.assert_close(f(x, w), torch.nn.functional.rms_norm(x + 1, (64,), w) * 2)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("capability,width", [("avx2", "256"), ("default", "0")])
def test_inductor_matches_the_aten_capability_it_runs_beside(capability, width):
    """Under ``ATEN_CPU_CAPABILITY`` (how CI runs another CPU's kernels) inductor alone built
    wrong kernels (avx2 on an AVX-512 machine: off by 1e29) or none (default); with its vector
    width pinned to the same capability its add + RMSNorm equals eager."""
    import os
    import subprocess
    import sys

    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    run = subprocess.run([sys.executable, "-c", _ISA_CHECK], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == [width, "ok"]


def test_the_vector_width_is_left_alone_when_set_or_not_asked(monkeypatch):
    from torch._inductor import config

    # config.patch, not monkeypatch: monkeypatch's undo deletes an inductor config entry, and
    # every later compile in the process then fails ("cpp.simdlen does not exist")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    with config.patch({"cpp.simdlen": None}):
        assert piecewise.match_aten_vector_width() is None and config.cpp.simdlen is None
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx512")
    with config.patch({"cpp.simdlen": 256}):  # the user's own choice stands
        assert piecewise.match_aten_vector_width() is None and config.cpp.simdlen == 256


def test_packed_weights_are_the_linear_layer_and_follow_in_place_updates():
    model = testing.tiny_model(seed=12)
    if packed_linear.cannot_pack(model) is not None:
        pytest.skip(f"no packing here: {packed_linear.cannot_pack(model)}")
    fuse_model(model)
    layer = model.model.layers[0]
    packs = packed_linear.PackedWeights(layer)
    # one packed copy per plain or fused linear, named as the template's buffers
    assert set(packs.packed) == {"self_attn.o_proj.packed", "self_attn.qkv_proj.packed",
                                 "mlp.gate_up_proj.packed", "mlp.down_proj.packed"}
    x = torch.randn(3, 5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    w = layer.self_attn.qkv_proj.weight
    got = packed_linear.packed_linear(x, packs.packed["self_attn.qkv_proj.packed"])
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert not packs.refresh()  # nothing changed: nothing repacked
    with torch.no_grad():
        layer.self_attn.q_proj.weight.mul_(2)  # a view of the fused weight, updated in place
    assert packs.refresh()
    got = packed_linear.packed_linear(x, packs.packed["self_attn.qkv_proj.packed"])
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    template = packed_linear.use_packed_weights(copy.deepcopy(layer).to("meta"))
    assert type(template.mlp.down_proj).__name__ == "_PackedLinear"
    assert template.mlp.down_proj.packed.shape == layer.mlp.down_proj.weight.shape
    assert packed_linear.cannot_pack(model.to(torch.bfloat16)) is not None


def test_a_compiled_engine_sees_weights_updated_in_place():
    """The packed copies and the dot-product graphs read the weights the engine updates
    (``LLMEngine.update_weights`` copies in place): after an update, the compiled engine's
    greedy tokens are the new weights' ``generate`` tokens, not the old ones'."""
    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    model, new = testing.tiny_model(seed=13), testing.tiny_model(seed=14)
    prompts = _prompts()[:3]
    want_new = [generate(new, p, 8, ignore_eos=True) for p in prompts]
    sp = labkit.SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = labkit.LLM.from_model(model, None, fused=True, compile=True, compile_sizes=(1, 4),
                                **CHUNKED)
    old = _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=sp))
    assert old != want_new
    llm.llm_engine.update_weights(new.state_dict(), version="v2")
    assert _tokens(llm.generate(prompt_token_ids=prompts, sampling_params=sp)) == want_new
