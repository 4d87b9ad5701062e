"""Engine features from ``labkit serve``'s command line (vLLM's flag names): the parsed flags
build the server's engine, and its greedy text equals the in-process engine's with the same
settings (the model prepared independently here); impossible combinations exit 2 at start."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import httpx
import pytest
from serve_helpers import NAME

from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.quant.model import quantize_model
from labkit.serve.api_server import ServeConfig
from labkit.serve.engine_core import build_engine
from labkit.serve.launcher import ENGINE_FLAGS, ServerThread, build_parser, main
from labkit.serve.metrics import ServerMetrics, parse_metrics

PROMPT = "def fib(n):"
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
BASE = ["--engine-mode", "thread", "--num-blocks", "64", "--max-num-seqs", "4"]


def served_text(argv: list[str], max_tokens: int = 12, extra: dict | None = None
                ) -> tuple[str, object, httpx.Response | None]:
    """Parse argv as `labkit serve` does, build its engine, answer one greedy completion
    (and, given ``extra`` fields, return that second request's response as well)."""
    args = build_parser().parse_args(argv + BASE)
    kw = {k: getattr(args, k) for k in ENGINE_FLAGS}
    eng, tok, _ = build_engine(args.model, dtype=args.dtype, device=args.device, **kw)
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    second = None
    with ServerThread(eng, tok, ServeConfig(model_name=NAME)) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json=body)
        info = httpx.get(srv.url + "/v1/models").json()["data"][0]
        if extra is not None:
            second = httpx.post(srv.url + "/v1/completions", timeout=120,
                                json={**body, **extra})
    assert r.status_code == 200, r.text
    assert info["id"] == NAME
    return r.json()["choices"][0]["text"], eng, second


def in_process(model_tok, max_tokens: int = 12, **kw) -> str:
    llm = LLM(model_tok, num_blocks=64, max_num_seqs=4, **kw)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    return llm.generate([PROMPT], sp)[0].outputs[0].text


@pytest.fixture(scope="module")
def int4(labkit_tiny):
    m, tok = labkit_tiny
    return quantize_model(m, "int4_rtn", group_size=64), tok  # one group size: a checkpoint


@pytest.mark.slow
@pytest.mark.parametrize("flag, fmt", [("int8", "int8"), ("int4", "int4_rtn"), ("nf4", "nf4")])
def test_quantization_at_load(labkit_tiny, flag, fmt):
    m, tok = labkit_tiny
    want = in_process((quantize_model(m, fmt, group_fallback=True), tok))
    got, eng, _ = served_text(["labkit-tiny", "--quantization", flag])
    assert got == want
    kinds = {type(mod).__name__ for mod in eng.executor.model.model.layers.modules()}
    assert "Linear" not in kinds, kinds  # every decoder linear was swapped


@pytest.mark.slow
def test_gptq_checkpoint_with_ngram_speculation(int4, tmp_path):
    """The issue's check: --quantization gptq --speculative-config ngram == in-process."""
    from labkit.model.loader import resolve_model_path
    from labkit.quant.checkpoint import load_quantized, save_quantized

    folder = save_quantized(int4[0], tmp_path / "tiny-gptq", resolve_model_path("labkit-tiny"))
    want = in_process((load_quantized(folder), int4[1]), speculative_config=json.loads(NGRAM))
    got, eng, r = served_text([str(folder), "--quantization", "gptq", "--speculative-config",
                               NGRAM], extra={"guided_choice": ["a", "b"]})
    assert got == want
    assert eng.config.speculative.method == "ngram"
    if importlib.util.find_spec("xgrammar") is not None:  # constrained under speculation
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in ("a", "b")


@pytest.mark.slow
def test_kv_cache_int8_and_no_prefix_caching(labkit_tiny):
    want = in_process(labkit_tiny, kv_cache_dtype="int8", enable_prefix_caching=False)
    got, eng, _ = served_text(["labkit-tiny", "--kv-cache-dtype", "int8",
                            "--no-enable-prefix-caching"])
    assert got == want
    assert eng.config.cache.kv_cache_dtype == "int8"
    assert eng.config.cache.enable_prefix_caching is False


@pytest.mark.slow
def test_triton_attention_backend(labkit_tiny):
    """On CPU the Triton kernel runs in its interpreter (tests/conftest.py): two tokens."""
    want = in_process(labkit_tiny, 2, attention_backend="triton")
    got, eng, _ = served_text(["labkit-tiny", "--attention-backend", "triton"], 2)
    assert got == want and eng.config.model.attention_backend == "triton"


@pytest.mark.slow
def test_kv_offload_flags_build_the_offloading_connector(labkit_tiny, tmp_path):
    want = in_process(labkit_tiny)  # no connector: its output must not change
    got, eng, again = served_text(["labkit-tiny", "--kv-offload-cpu-bytes", "4096",
                                   "--kv-offload-dir", str(tmp_path),
                                   "--kv-offload-disk-bytes", "1000000"], extra={})
    assert got == want and again.json()["choices"][0]["text"] == want
    conn = eng.kv_connector
    assert (conn.cpu_bytes, conn.disk_dir, conn.disk_bytes) == (4096, str(tmp_path), 1000000)
    s = eng.stats()["kv_connector"]
    assert eng.config.cache.bytes_per_block > 4096  # no block fits the CPU tier: all to disk
    assert s["cpu"]["blocks"] == 0 and s["disk"]["stores"] == s["disk"]["blocks"] > 0
    scraped = parse_metrics(ServerMetrics(SimpleNamespace(stats=eng.stats(), num_in_flight=0),
                                          NAME).render().decode())
    assert scraped["labkit:kv_connector_bytes_stored_total"] == s["disk"]["bytes_stored"]
    assert scraped["labkit:kv_connector_bytes_used"] == s["disk"]["bytes_used"] > 0
    assert scraped["labkit:kv_connector_corrupt_total"] == 0
    conn.close()


def test_flags_default_to_the_engine_defaults():
    args = build_parser().parse_args(["labkit-tiny"])
    assert all(getattr(args, k) is None for k in ("quantization", "speculative_config",
                                                  "kv_cache_dtype", "attention_backend",
                                                  "enable_prefix_caching",
                                                  "kv_transfer_config", "kv_offload_dir",
                                                  "kv_offload_cpu_bytes",
                                                  "kv_offload_disk_bytes"))
    args = build_parser().parse_args(["m", "--speculative-config", NGRAM,
                                      "--enable-prefix-caching"])
    assert args.speculative_config["method"] == "ngram" and args.enable_prefix_caching is True


@pytest.mark.parametrize("argv", [
    ["labkit-tiny", "--quantization", "gguf"],  # gguf needs a .gguf file
    ["labkit-tiny", "--quantization", "gptq"],  # gptq needs a quantized folder
    ["labkit-tiny", "--quantization", "int3"],
    ["labkit-tiny", "--quantization", "int8", "--tensor-parallel-size", "2"],
    ["labkit-tiny", "--speculative-config", "[1, 2]"],
    ["labkit-tiny", "--speculative-config", "{not json"],
    ["labkit-tiny", "--kv-cache-dtype", "fp4"],
    ["labkit-tiny", "--kv-offload-cpu-bytes", "4096", "--kv-transfer-config",
     '{"kv_connector": "offloading"}'],
])
def test_impossible_combinations_exit_2_at_start(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--engine-mode", "thread"])
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_seed_and_features_in_v1_models(labkit_tiny):
    """``--seed``: unseeded sampled requests get seeds from the server's seeded generator, so a
    restarted server with the same seed answers the same request sequence with the same text
    (and a different seed does not); ``/v1/models`` names the features the server runs."""
    from labkit.serve.engine_flags import features_of

    args = build_parser().parse_args(["labkit-tiny", "--seed", "7", "--kv-cache-dtype", "int8",
                                      "--speculative-config", NGRAM])
    feats = features_of(args)
    assert feats["seed"] == 7 and feats["kv_cache_dtype"] == "int8"
    assert feats["speculative_config"]["method"] == "ngram"
    m, tok = labkit_tiny
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}

    def texts(seed: int | None) -> list[str]:
        eng, _, _ = build_engine("labkit-tiny", num_blocks=64, max_num_seqs=4)
        cfg = ServeConfig(model_name=NAME, seed=seed, features={"seed": seed})
        with ServerThread(eng, tok, cfg) as srv:
            card = httpx.get(srv.url + "/v1/models").json()["data"][0]
            assert card["labkit"] == {"seed": seed}
            return [httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
                    ["choices"][0]["text"] for _ in range(3)]

    first, again, other = texts(7), texts(7), texts(8)
    assert first == again
    assert len(set(first)) > 1  # each request its own seed, not one seed for all
    assert other != first
