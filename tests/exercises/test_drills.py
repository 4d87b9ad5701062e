"""Drills: every snippet runs (and its own asserts hold), the seed topics are covered, and the
`labkit drill` command behaves like an argparse CLI."""

import re

import pytest

from labkit.exercises import drills
from labkit.exercises.drills import DRILLS, TOPICS, main, run_snippet

# The topics the seed notes (shared/seeds/README.md) ask a learner to master.
SEED_TOPICS = {
    "paged-attention", "batching", "prefix-caching", "quantization", "speculative-decoding",
    "metrics", "scheduling", "watermarks", "streaming", "rate-limiting", "gpu-sharing",
    "releases", "gateways", "autoscaling", "failover", "monitoring", "multi-tenancy", "moe",
    "llama-cpp", "tensorrt-llm", "kv-cache", "frameworks", "compression",
    "parallelism", "weight-loading", "lora", "on-device", "safety",
}


def test_seed_topics_covered():
    assert SEED_TOPICS <= set(TOPICS)


def test_drill_ids_unique_and_fields_filled():
    assert len({x.id for x in DRILLS}) == len(DRILLS)
    for x in DRILLS:
        assert x.question.endswith("?"), x.id
        assert len(x.answer) > 80, x.id


@pytest.mark.parametrize("drill", [x for x in DRILLS if x.snippet], ids=lambda x: x.id)
def test_snippet_runs_and_prints(drill):
    out = output_of(drill.id)
    assert out.strip(), f"snippet {drill.id} printed nothing"


def test_most_drills_have_snippets():
    assert sum(1 for x in DRILLS if x.snippet) >= 0.8 * len(DRILLS)


def test_cli_lists_topics(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert f"{len(DRILLS)} drills" in out and "paged-attention" in out


def test_cli_topic_and_alias(capsys):
    assert main(["mig"]) == 0
    out = capsys.readouterr().out
    assert "[gpu-sharing / mig]" in out and "A: " in out and "try it:" in out


def test_cli_unknown_topic_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["warp-drive"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: labkit drill" in err
    assert "unknown topic 'warp-drive'; valid topics: kv-cache, paged-attention" in err


def test_cli_bad_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--nope"])
    assert e.value.code == 2


def test_cli_run_shows_output(capsys):
    assert main(["kv-cache", "--run"]) == 0
    out = capsys.readouterr().out
    assert "output:" in out and "512 KiB/token" in out


def test_cli_search(capsys):
    assert main(["--search", "Server-Sent"]) == 0
    assert "[streaming / sse]" in capsys.readouterr().out
    assert main(["--search", "zzzz-no-such-thing"]) == 1


def test_cli_random_is_seeded(capsys):
    main(["--random", "--seed", "3"])
    first = capsys.readouterr().out
    main(["--random", "--seed", "3"])
    assert capsys.readouterr().out == first


def test_cli_quiz_without_tty(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: False, raising=False)
    assert main(["watermarks", "--quiz"]) == 0
    out = capsys.readouterr().out
    assert out.index("Q: ") < out.index("A: ")


def test_resolve_topic_errors():
    with pytest.raises(ValueError, match="valid topics"):
        drills.resolve_topic("nope")
    assert drills.resolve_topic("TTFT") == "metrics"


def test_cli_progress(capsys):
    from labkit.exercises import progress

    progress.record("spec_speedup", True)
    assert main(["--progress"]) == 0
    out = capsys.readouterr().out
    assert f"1/{len(progress.EXERCISES)} exercises passed" in out and "✓ spec_speedup" in out


# --- The scale-out and deployment drills (drills_scale, drills_deploy) ---------------------------
# Each snippet prints the numbers its answer quotes; these tests recompute them by hand from the
# models' public config.json values and the stated hardware assumptions, not from the drill code.

NEW_DRILLS = {
    "tp-split": "parallelism", "tp-vs-pp": "parallelism", "safetensors-mmap": "weight-loading",
    "cold-start": "weight-loading", "hot-update": "releases", "lora-memory": "lora",
    "lora-batching": "lora", "qlora-deploy": "lora", "on-device": "on-device",
    "safety-review": "safety", "cuda-graphs": "tensorrt-llm",
    "overlap-scheduling": "tensorrt-llm",
}


def test_bank_size_matches_readme():
    # README: "labkit drill  # 58 drills in 29 topics"
    assert len(DRILLS) == 58 and len(TOPICS) == 29
    by_id = {x.id: x.topic for x in DRILLS}
    assert {k: by_id.get(k) for k in NEW_DRILLS} == NEW_DRILLS


_outputs: dict[str, str] = {}


def output_of(drill_id: str) -> str:
    if drill_id not in _outputs:
        _outputs[drill_id] = run_snippet(next(x for x in DRILLS if x.id == drill_id))
    return _outputs[drill_id]


def grab(pattern: str, text: str) -> list[float]:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not in output:\n{text}"
    return [float(g.replace(",", "")) for g in m.groups()]


def llama_params(layers, d, heads, kv_heads, head_dim, ffn, vocab, tied=False):
    attn = 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim
    return (1 if tied else 2) * vocab * d + layers * (attn + 3 * d * ffn + 2 * d) + d


P70B = llama_params(80, 8192, 64, 8, 128, 28672, 32000)
P7B = llama_params(32, 4096, 32, 32, 128, 11008, 32000)
P1B = llama_params(16, 2048, 32, 8, 64, 8192, 128256, tied=True)
P8B = llama_params(32, 4096, 32, 8, 128, 14336, 128256)
H100_MEM, H100_BW, H100_FLOPS = 80 * 2**30, 3.35e12, 989e12
A100_BW, A100_FLOPS, OVERHEAD = 2.039e12, 312e12, 0.5e-3


def test_hand_param_counts_are_the_published_ones():
    assert (P7B, P70B, P1B, P8B) == (6_738_415_616, 68_976_648_192, 1_235_814_400,
                                     8_030_261_248)


def test_tp_split_numbers():
    out = output_of("tp-split")
    for tp in (4, 8, 16):
        weights, kv, room = grab(rf"TP={tp}: weights ([\d.]+) GB/GPU, KV (\d+) B/token/GPU, "
                                 r"KV room (\d+) tokens", out)
        kv_heads_here = -(-8 // tp)  # a GPU holds at least one whole KV head
        kv_hand = 2 * 80 * kv_heads_here * 128 * 2
        assert weights == round(2 * P70B / tp / 1e9, 2)
        assert kv == kv_hand
        assert abs(room - (0.9 * H100_MEM - 2 * P70B / tp) / kv_hand) <= 1
    assert grab(r"all-reduces per forward pass: (\d+)", out) == [160]


def ring_allreduce(chunks_per_rank: list[list[float]]) -> tuple[list[list[float]], list[int]]:
    """A plain ring all-reduce (reduce-scatter then all-gather), counting elements each rank
    sends, to check the 2 x (N-1)/N volume the drill uses."""
    n = len(chunks_per_rank)
    data = [list(c) for c in chunks_per_rank]
    size = len(data[0])
    seg = [list(range(i * size // n, (i + 1) * size // n)) for i in range(n)]
    sent = [0] * n
    for step in range(n - 1):  # reduce-scatter: rank r sends segment (r - step) to r + 1
        msgs = [(r, (r - step) % n, [data[r][i] for i in seg[(r - step) % n]]) for r in range(n)]
        for r, s, vals in msgs:
            sent[r] += len(vals)
            for i, v in zip(seg[s], vals):
                data[(r + 1) % n][i] += v
    for step in range(n - 1):  # all-gather: rank r sends its finished segment (r + 1 - step)
        msgs = [(r, (r + 1 - step) % n, [data[r][i] for i in seg[(r + 1 - step) % n]])
                for r in range(n)]
        for r, s, vals in msgs:
            sent[r] += len(vals)
            for i, v in zip(seg[s], vals):
                data[(r + 1) % n][i] = v
    return data, sent


def test_ring_allreduce_volume():
    n, size = 8, 64
    chunks = [[float(r * 100 + i) for i in range(size)] for r in range(n)]
    result, sent = ring_allreduce(chunks)
    total = [sum(c[i] for c in chunks) for i in range(size)]
    assert all(row == total for row in result)
    assert sent == [2 * (n - 1) * size // n] * n  # 2 (N-1)/N of the message, per rank


def test_tp_vs_pp_numbers():
    out = output_of("tp-vs-pp")
    per_layer = 2 * 2 * 7 / 8 * 8192 * 2  # two all-reduces of one bf16 activation, TP=8
    assert per_layer == 57_344
    tp_bytes, pp_bytes = grab(r"TP sends ([\d,]+) B per GPU; PP sends ([\d,]+) B", out)
    assert tp_bytes == 80 * per_layer == 4_587_520 and pp_bytes == 8192 * 2
    tp_ms, pp_ms = grab(r"TP ([\d.]+) ms/token, PP ([\d.]+) ms/token", out)
    assert tp_ms == round(2 * P70B / 8 / H100_BW * 1e3, 1) == 5.1
    assert pp_ms == round(2 * P70B / H100_BW * 1e3, 1) == 41.2
    compute_ms = 2 * P70B * 2048 / 8 / H100_FLOPS * 1e3
    for bw, label in ((450e9, "NVLink"), (50e9, "InfiniBand")):
        comm, compute = grab(rf"all-reduce (\d+) ms over {label}.*compute (\d+) ms", out)
        assert comm == round(80 * per_layer * 2048 / bw * 1e3) and compute == round(compute_ms)
    assert "21 ms" in drills_by_id()["tp-vs-pp"].answer.replace("about ", "")


def drills_by_id():
    return {x.id: x for x in DRILLS}


def test_safetensors_mmap_numbers():
    import torch
    from safetensors.torch import load_file

    from labkit.model.loader import resolve_model_path

    out = output_of("safetensors-mmap")
    header, count, data = grab(r"header (\d+) B for (\d+) tensors, data (\d+) B", out)
    path = resolve_model_path("labkit-tiny") / "model.safetensors"
    tensors = load_file(str(path))
    assert count == len(tensors)
    assert data == sum(t.numel() * t.element_size() for t in tensors.values())
    assert path.stat().st_size == 8 + header + data
    assert tensors["model.embed_tokens.weight"].dtype == torch.float16
    net, nvme, warm = grab(r"cold ([\d.]+) s from a 1 GB/s network disk, ([\d.]+) s from a "
                           r"7 GB/s local NVMe; warm page cache to GPU ([\d.]+) s", out)
    assert (net, nvme) == (round(2 * P7B / 1e9, 1), round(2 * P7B / 7e9, 1)) == (13.5, 1.9)
    assert warm == round(2 * P7B / 25e9, 2)


def test_cold_start_numbers():
    out = output_of("cold-start")
    size = 2 * P70B
    for label, bw in (("one S3 GET stream", 0.1e9), ("100 Gb/s NIC", 12.5e9),
                      ("local NVMe drive", 7e9)):
        assert grab(rf"{label}: ([\d,.]+) s", out) == [round(size / bw, 1)]
    warm, everyone = grab(r"to 8 GPUs: ([\d.]+) s; .* NIC: ([\d.]+) s", out)
    assert warm == round(size / 8 / 25e9, 2) and everyone == round(8 * size / 12.5e9, 1)
    assert size / 0.1e9 > 20 * 60  # "over 20 minutes"


def test_hot_update_numbers():
    out = output_of("hot-update")
    batch, ctx = 64, 64 * 1024
    flops = 2 * P7B * batch + 4 * 32 * 32 * 128 * (ctx + batch)
    memory = (2 * P7B + 2 * 32 * 32 * 128 * 2 * (ctx + batch)) / A100_BW
    assert flops / A100_FLOPS < memory  # decode at batch 64 is memory-bound
    step = memory + OVERHEAD
    drain, step_ms = grab(r"stream: (\d+) s at ([\d.]+) ms/step", out)
    assert step_ms == round(step * 1e3, 1) and drain == round(4096 * step) and drain > 30
    stale, fresh = grab(r"max logit error ([\d.]+); over its own KV: ([\d.e+-]+)", out)
    assert stale > 1e-2 and fresh < 1e-4
    assert grab(r"shared across versions: (\d+)", out) == [0]


def test_lora_memory_numbers():
    out = output_of("lora-memory")
    h, ffn, layers = 4096, 11008, 32
    rank16 = layers * 16 * (4 * (h + h) + 3 * (h + ffn))
    rank8_qv = layers * 8 * 2 * (h + h)
    linear = layers * (4 * h * h + 3 * h * ffn)
    a16, mb16, share, a8, mb8 = grab(r"all linears: ([\d,]+) params = ([\d.]+) MB \(([\d.]+)%"
                                     r".*q\+v: ([\d,]+) params = ([\d.]+) MB", out)
    assert (a16, a8) == (rank16, rank8_qv) == (39_976_960, 4_194_304)
    assert mb16 == round(2 * rank16 / 1e6, 1) and mb8 == round(2 * rank8_qv / 1e6, 1)
    assert share == round(100 * rank16 / linear, 2)
    hundred, merged = grab(r"100 adapters: ([\d.]+) GB .* 100 merged copies: ([\d.]+) TB", out)
    assert hundred == round(100 * 2 * rank16 / 1e9, 1) and merged == round(100 * 2 * P7B / 1e12, 2)


def test_lora_batching_numbers():
    out = output_of("lora-batching")
    (err,) = grab(r"merged weights: ([\d.e+-]+);", out)
    assert err < 1e-5
    assert grab(r"4096x4096 projection: ([\d.]+)%", out) == [round(100 * 16 * 8192 / 4096**2, 2)]


NF4_LEVELS = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
              -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
              0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
              0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
              0.7229568362236023, 1.0]  # QLoRA paper, appendix E / bitsandbytes


def test_qlora_deploy_numbers():
    import torch

    out = output_of("qlora-deploy")
    g = torch.Generator().manual_seed(0)  # the drill's draws, in its order
    W = torch.randn(128, 256, generator=g) * 0.02
    A = torch.randn(16, 256, generator=g) * 0.01
    B = torch.randn(128, 16, generator=g) * 0.01
    x = torch.randn(32, 256, generator=g)
    blocks = W.reshape(-1, 64)  # NF4 by hand: absmax per 64, nearest normal-quantile level
    absmax = blocks.abs().amax(1, keepdim=True)
    levels = torch.tensor(NF4_LEVELS)
    nearest = levels[((blocks / absmax)[..., None] - levels).abs().argmin(-1)]
    Wq = (nearest * absmax).reshape(W.shape)
    trained = x @ Wq.T + x @ A.T @ B.T
    expected = ((x @ (W - Wq).T).norm() / trained.norm()).item()  # the lost NF4 error
    (dequant,) = grab(r"merged into dequantized NF4: relative output error ([\d.e+-]+)", out)
    (original,) = grab(r"merged into original fp16: relative output error ([\d.e+-]+)", out)
    (requant,) = grab(r"re-quantized to INT4 g64: relative output error ([\d.e+-]+)", out)
    assert dequant < 1e-5 and requant > 1e-3
    assert abs(original - expected) < 0.01 * expected


def gptq_bytes(linears, other_params):
    """4-bit codes + fp16 scale and 4-bit zero per 128 inputs + int32 g_idx; rest in fp16."""
    q = sum(o * i // 2 + (i // 128) * o * 2 + (i // 128) * o // 2 + 4 * i for o, i in linears)
    return q + 2 * other_params


def test_on_device_numbers():
    out = output_of("on-device")
    bw = 60e9
    lin7 = [(4096, 4096)] * 4 * 32 + [(11008, 4096)] * 2 * 32 + [(4096, 11008)] * 32
    lin1 = ([(2048, 2048)] * 2 + [(512, 2048)] * 2 + [(8192, 2048)] * 2 + [(2048, 8192)]) * 16
    emb7, emb1 = 32000 * 4096, 128256 * 2048
    int4_7 = gptq_bytes(lin7, 2 * emb7 + 65 * 4096)
    int4_1 = gptq_bytes(lin1, emb1 + 33 * 2048)
    cases = {("Llama-2-7B", "fp16"): (2 * P7B, 2 * P7B - 2 * emb7),
             ("Llama-2-7B", "gptq"): (int4_7, int4_7 - 2 * emb7),  # lookup reads one row
             ("Llama-3.2-1B", "fp16"): (2 * P1B, 2 * P1B),  # tied: the LM head reads it all
             ("Llama-3.2-1B", "gptq"): (int4_1, int4_1)}
    for (label, fmt), (size, read) in cases.items():
        gb, tps = grab(rf"{label} {fmt}: ([\d.]+) GB \(.*\), <= ([\d.]+) tokens/s", out)
        assert gb == round(size / 1e9, 2) and tps == round(bw / read, 1)
    assert "13.48 GB (does not fit in 12 GB)" in out
    (share,) = grab(r"embedding/LM head = (\d+)%", out)
    assert share == round(100 * 2 * (emb1 + 33 * 2048) / int4_1)
    assert grab(r"KV (\d+) KiB/token", out) == [2 * 16 * 8 * 64 * 2 // 1024]


def prefill_s(params, layers, heads, head_dim, kv_bytes_per_token, tokens, context=0):
    """labkit's roofline by hand: max(FLOPs / peak, bytes / bandwidth) + per-step overhead."""
    pairs = context + tokens + tokens**2 // 2
    flops = 2 * params * tokens + 4 * layers * heads * head_dim * pairs
    nbytes = 2 * params + kv_bytes_per_token * (context + tokens)
    return max(flops / A100_FLOPS, nbytes / A100_BW) + OVERHEAD


def test_safety_review_numbers():
    out = output_of("safety-review")
    kv7, kv1, kv8 = 2 * 32 * 32 * 128 * 2, 2 * 16 * 8 * 64 * 2, 2 * 32 * 8 * 128 * 2
    main = prefill_s(P7B, 32, 32, 128, kv7, 2000)
    guards = {"llama-3.2-1b": prefill_s(P1B, 16, 32, 64, kv1, 2000),
              "llama-3-8b": prefill_s(P8B, 32, 32, 128, kv8, 2000)}
    for name, guard in guards.items():
        got = grab(rf"{name} guard (\d+) ms: TTFT serial (\d+) ms, in parallel (\d+) ms", out)
        assert got == [round(guard * 1e3), round((main + guard) * 1e3),
                       round(max(main, guard) * 1e3)]
    assert guards["llama-3.2-1b"] < main < guards["llama-3-8b"]  # hidden vs critical path
    tpot = (2 * P7B + kv7 * (32 * 1024 + 32)) / A100_BW + OVERHEAD  # memory-bound decode
    check = prefill_s(P1B, 16, 32, 64, kv1, 16, context=2000)
    held, tpot_ms, check_ms = grab(r"window: (\d+) ms \(TPOT ([\d.]+) ms, check ([\d.]+) ms", out)
    assert (tpot_ms, check_ms) == (round(tpot * 1e3, 1), round(check * 1e3, 1))
    assert held == round((16 * tpot + check) * 1e3)


@pytest.mark.parametrize("word,drill_id", [
    ("tensor", "tp-split"), ("pipeline", "tp-vs-pp"), ("all-reduce", "tp-split"),
    ("safetensors", "safetensors-mmap"), ("mmap", "safetensors-mmap"), ("S3", "cold-start"),
    ("drain", "hot-update"), ("LoRA", "lora-memory"), ("S-LoRA", "lora-batching"),
    ("Punica", "lora-batching"), ("QLoRA", "qlora-deploy"), ("NPU", "on-device"),
    ("phone", "on-device"), ("Llama Guard", "safety-review"), ("safety", "safety-review"),
])
def test_search_finds_new_drills(word, drill_id):
    assert drill_id in [x.id for x in drills.search(word)]


@pytest.mark.parametrize("alias,topic", [
    ("tp", "parallelism"), ("PP", "parallelism"), ("safetensors", "weight-loading"),
    ("qlora", "lora"), ("npu", "on-device"), ("moderation", "safety"),
    ("hot-update", "releases"),
])
def test_new_aliases(alias, topic):
    assert drills.resolve_topic(alias) == topic


def test_cli_new_topic(capsys):
    assert main(["tp", "--run"]) == 0
    out = capsys.readouterr().out
    assert "[parallelism / tp-split]" in out and "[parallelism / tp-vs-pp]" in out
    assert "4,587,520 B per GPU" in out


# --- Search by id, topic and word stem (issue 19) -------------------------------------------------

@pytest.mark.parametrize("query", ["preemption", "preempt", "Preempted", "preempting",
                                   "preemptions", "sched-preempt"])
def test_search_finds_preemption_drill_first(query):
    assert [x.id for x in drills.search(query)][0] == "sched-preempt"


@pytest.mark.parametrize("query,drill_id", [
    ("watermark", "watermark"), ("watermarks", "watermark"), ("hysteresis", "watermark"),
    ("block table", "block-table"), ("block tables", "block-table"), ("kv-size", "kv-size"),
    ("quantize", "quant-per-channel"), ("quantized", "quant-gptq-awq"), ("caching", "prefix-hash"),
    ("cached", "prefix-evict"), ("streamed", "sse"), ("batches", "batching-static"),
    ("speculative decoding", "spec-speedup"), ("draining", "hot-update"),
])
def test_search_stems(query, drill_id):
    assert drill_id in [x.id for x in drills.search(query)]


def test_stem_is_shared_by_word_forms():
    forms = {"preempt": ["preemption", "preemptions", "preempted", "preempting", "preempts"],
             "cach": ["cache", "caches", "cached", "caching"],
             "quantiz": ["quantize", "quantized", "quantization", "Quantization"]}
    for root, words in forms.items():
        assert {drills.stem(w) for w in words} == {root}, root
    assert drills.stem("MIG") != drills.stem("might") and drills.stem("kv") == "kv"


def test_search_ranks_id_and_topic_before_mentions():
    ids = [x.id for x in drills.search("watermark")]
    assert ids[0] == "watermark" and "tail-latency" in ids  # the tail drill only mentions it
    topic_hits = [x.topic for x in drills.search("prefix-caching")]
    assert topic_hits[:3] == ["prefix-caching"] * 3


def test_search_topic_alias():
    ids = [x.id for x in drills.search("ttft")]  # "ttft" is an alias of the metrics topic
    assert ids[0] == "prefix-ttft"  # named in its id: first
    assert {"metrics-defs", "metrics-roofline", "metrics-tradeoff"} <= set(ids[1:5])


def test_search_matches_words_not_substrings():
    assert "mig" not in [x.id for x in drills.search("might")]
    assert drills.search("reempt") == []  # no substring matches inside words


def test_search_empty_query_is_an_error():
    with pytest.raises(ValueError, match="empty search"):
        drills.search("  ")


def test_cli_search_preempt(capsys):
    assert main(["--search", "preempt"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[scheduling / sched-preempt]")


# --- Claims about named systems carry their source (issue 19) ------------------------------------

from labkit.exercises.drills_sources import SOURCES, SYSTEMS  # noqa: E402


def named_systems(drill) -> set[str]:
    text = f"{drill.question} {drill.answer}"
    return {name for name, pattern in SYSTEMS.items() if re.search(pattern, text)}


@pytest.mark.parametrize("drill", DRILLS, ids=lambda x: x.id)
def test_every_named_system_has_a_sourced_claim(drill):
    missing = named_systems(drill) - {c.system for c in drill.claims}
    assert not missing, f"{drill.id} names {sorted(missing)} without a Claim in drills_sources"
    for claim in drill.claims:
        assert claim.claim.strip() and claim.system in SYSTEMS, (drill.id, claim)
        # a repository path ("owner/repo: path") or a documentation / paper URL
        assert re.search(r"https://\S+|^[\w.-]+/[\w.-]+: \S+", claim.source), (drill.id, claim)


def test_sources_only_for_existing_drills():
    assert set(SOURCES) <= {x.id for x in DRILLS}


def test_audit_finds_the_systems_the_bank_names():
    # the detector is not vacuous: these drills name these systems
    by_id = {x.id: x for x in DRILLS}
    assert {"TGI", "vLLM"} <= named_systems(by_id["watermark"])
    assert {"Transformers", "vLLM", "SGLang", "llama.cpp"} <= named_systems(by_id["frameworks"])
    assert sum(bool(named_systems(x)) for x in DRILLS) >= 20


def test_watermark_drill_says_what_each_server_does():
    answer = next(x for x in DRILLS if x.id == "watermark").answer
    for term in ("max_batch_total_tokens", "waiting_served_ratio", "hysteresis", "V1",
                 "never preempted"):
        assert term in answer
    assert "TGI and similar servers stop admitting" not in answer  # the old, wrong claim


@pytest.mark.slow
def test_transformers_cache_claims_hold_for_the_installed_transformers():
    """The frameworks drill: DynamicCache (generate's default) grows token by token, StaticCache
    pre-allocates max_cache_len. Checked against transformers itself, not against the text."""
    import torch
    from transformers import DynamicCache, LlamaConfig, StaticCache

    answer = next(x for x in DRILLS if x.id == "frameworks").answer
    assert "DynamicCache grows" in answer and "pre-allocates KV contiguously" not in answer
    dynamic = DynamicCache()
    lengths = []
    for n in (5, 1, 1):
        k = torch.zeros(1, 2, n, 16)
        dynamic.update(k, k, layer_idx=0)
        lengths.append(dynamic.layers[0].keys.shape[-2])
    assert lengths == [5, 6, 7]
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=1, intermediate_size=128, vocab_size=100)
    static = StaticCache(config=cfg, max_cache_len=32)
    k = torch.zeros(1, 2, 5, 16)
    static.update(k, k, layer_idx=0, cache_kwargs={"cache_position": torch.arange(5)})
    assert static.layers[0].keys.shape[-2] == 32


# --- Drills in Chinese (issue 19) -----------------------------------------------------------------

from labkit.exercises.drills_zh_core import TOPICS_ZH  # noqa: E402

CJK = re.compile(r"[\u4e00-\u9fff]")


def numbers(text: str) -> set[str]:
    """Every number as written (1,000 and 1000 are the same number)."""
    return {re.sub(r"(?<=\d),(?=\d{3})", "", n) for n in re.findall(r"\d+(?:[.,]\d+)*", text)}


@pytest.mark.parametrize("drill", DRILLS, ids=lambda x: x.id)
def test_drill_has_both_languages(drill):
    for en, zh in ((drill.question, drill.question_zh), (drill.answer, drill.answer_zh)):
        assert en.strip() and zh.strip(), drill.id
        assert not CJK.search(en), f"{drill.id}: the English text must stay English"
        letters = [c for c in zh if not c.isspace()]
        share = sum(bool(CJK.match(c)) for c in letters) / len(letters)
        assert share > 0.2, f"{drill.id}: only {share:.0%} of the Chinese text is Chinese"
    assert drill.question_zh.endswith("？"), drill.id  # a question, with Chinese punctuation
    assert len(drill.answer_zh) > 40, drill.id


@pytest.mark.parametrize("drill", DRILLS, ids=lambda x: x.id)
def test_chinese_states_the_same_numbers(drill):
    """Every number of the English question and answer appears in the Chinese one and no other,
    so a figure a snippet computes (and the English quotes) is the same in both languages."""
    assert numbers(drill.question_zh) == numbers(drill.question), drill.id
    assert numbers(drill.answer_zh) == numbers(drill.answer), drill.id


@pytest.mark.parametrize("drill", [x for x in DRILLS if x.snippet], ids=lambda x: x.id)
def test_computed_numbers_quoted_in_both_languages(drill):
    quoted = numbers(output_of(drill.id)) & numbers(drill.answer)
    assert quoted <= numbers(drill.answer_zh), (drill.id, sorted(quoted - numbers(drill.answer_zh)))


def test_numbers_detector():
    assert numbers("57,344 bytes, 0.9 and 4k at P99, Llama-2-7B") == {
        "57344", "0.9", "4", "99", "2", "7"}
    assert numbers("约 120k 个 token，60 个 2k 请求") == {"120", "60", "2"}


@pytest.mark.parametrize("drill_id,terms", [
    ("prefix-ttft", ["首 token 延迟", "前缀缓存"]), ("batching-static", ["连续批处理"]),
    ("paged-why", ["分页注意力", "碎片"]), ("sched-preempt", ["抢占", "重算"]),
    ("kv-size", ["KV 缓存", "分组查询注意力"]), ("quant-memory", ["显存"]),
    ("quant-per-channel", ["量化"]), ("spec-speedup", ["投机解码", "接受率"]),
    ("tp-split", ["张量并行"]), ("tp-vs-pp", ["流水线并行"]), ("watermark", ["水位线", "迟滞"]),
    ("cold-start", ["冷启动"]), ("canary", ["灰度发布"]), ("rate-limit", ["限流", "令牌桶"]),
])
def test_chinese_uses_the_interview_terms(drill_id, terms):
    drill = next(x for x in DRILLS if x.id == drill_id)
    for term in terms:
        assert term in drill.question_zh + drill.answer_zh, (drill_id, term)


def test_every_topic_has_a_chinese_name():
    assert set(TOPICS_ZH) == set(TOPICS)
    assert all(CJK.search(name) for name in TOPICS_ZH.values())
    assert drills.resolve_topic("前缀缓存") == "prefix-caching"
    assert drills.resolve_topic("KV缓存") == "kv-cache"


def test_format_drill_languages():
    drill = next(x for x in DRILLS if x.id == "kv-size")
    zh = drills.format_drill(drill, lang="zh")
    both = drills.format_drill(drill, lang="both")
    assert "问：" in zh and "答：" in zh and "Q: " not in zh and "动手试试：" in zh
    assert both.index("问：") < both.index("Q: ") < both.index("答：") < both.index("A: ")
    assert "Q: " in drills.format_drill(drill) and "问：" not in drills.format_drill(drill)
    with pytest.raises(ValueError, match="unknown language 'fr'"):
        drills.format_drill(drill, lang="fr")


@pytest.mark.parametrize("drill", DRILLS, ids=lambda x: x.id)
def test_wrap_keeps_text_and_width(drill):
    from labkit.exercises.drills import _width, wrap

    for text in (drill.answer_zh, drill.answer):
        lines = wrap(text, "答：").splitlines()
        assert "".join("".join(lines)[len("答："):].split()) == "".join(text.split()), drill.id
        for line in lines:  # 96 columns (+2 for a closing mark kept off the next line's start)
            assert _width(line) <= 98 or len(line.split()) == 1, (drill.id, line)
        for a, b in zip(lines, lines[1:]):  # never inside an English word or a number
            tail, head = re.findall(r"[A-Za-z0-9_]*$", a)[0], re.findall(r"^[A-Za-z0-9_]*",
                                                                          b.strip())[0]
            if tail and head:  # a break between two words must be where a space was
                assert f"{tail} {head}" in text, (drill.id, a, b)
            assert b.strip()[0] not in "，。、；：！？）》」』”", (drill.id, b)  # kinsoku
            assert a[-1] not in "（《「『“", (drill.id, a)
        assert len(lines) > 1


def test_cli_lang_zh(capsys):
    assert main(["prefix-caching", "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert "问：" in out and "前缀缓存" in out and "Q: " not in out
    assert main(["--lang", "zh"]) == 0
    assert "前缀缓存" in capsys.readouterr().out  # the topic list shows the Chinese names
    with pytest.raises(SystemExit) as e:
        main(["--lang", "fr"])
    assert e.value.code == 2


def test_cli_quiz_both_languages(capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin.isatty", lambda: False, raising=False)
    assert main(["watermarks", "--quiz", "--lang", "both"]) == 0
    out = capsys.readouterr().out
    assert out.index("问：") < out.index("Q: ") < out.index("答：") < out.index("A: ")
    assert "动手试试" not in out  # the quiz shows no snippet


@pytest.mark.parametrize("query,first", [
    ("抢占", "sched-preempt"), ("前缀缓存", "prefix-ttft"), ("投机解码", "spec-speedup"),
    ("首 token 延迟", "prefix-ttft"), ("张量并行", "tp-split"),
])
def test_search_chinese_terms(query, first):
    assert [x.id for x in drills.search(query)][0] == first


def test_search_chinese_ignores_spaces():
    assert drills.search("KV缓存") == drills.search("KV 缓存") != []


def test_cli_sources(capsys):
    assert main(["watermarks", "--sources"]) == 0
    out = capsys.readouterr().out
    assert "sources:" in out and "backends/v3/src/queue.rs" in out
    assert "vllm/core/block_manager.py" in out
    assert main(["watermarks"]) == 0 and "sources:" not in capsys.readouterr().out
    assert main(["watermarks", "--sources", "--lang", "zh"]) == 0
    assert "来源：" in capsys.readouterr().out


def test_cli_one_drill_by_id(capsys):
    assert main(["sched-preempt", "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[scheduling / sched-preempt]") and out.count("[scheduling") == 1


class _NotATensor:  # a pickled object torch.load must refuse by default (safetensors-mmap)
    pass


def test_torch_load_refuses_code_by_default(tmp_path):
    """safetensors-mmap: torch.load's weights_only mode is the default (PyTorch >= 2.6), so a
    pickle that would build an arbitrary object is refused unless the caller opts out."""
    import pickle

    import torch

    path = tmp_path / "model.bin"
    torch.save({"w": torch.ones(2), "extra": _NotATensor()}, path)
    with pytest.raises(pickle.UnpicklingError, match="[Ww]eights only load failed"):
        torch.load(path)
    assert torch.equal(torch.load(path, weights_only=False)["w"], torch.ones(2))


@pytest.mark.slow
def test_bitsandbytes_nf4_defaults():
    """quant-nf4: bitsandbytes quantizes NF4 in blocks of 64 and Linear4bit double-quantizes the
    block scales by default."""
    import inspect

    import torch

    functional = pytest.importorskip("bitsandbytes.functional")
    from bitsandbytes.nn import Linear4bit

    _, state = functional.quantize_4bit(torch.randn(256, dtype=torch.float16), quant_type="nf4")
    assert state.blocksize == 64
    assert inspect.signature(Linear4bit).parameters["compress_statistics"].default is True
    assert "Blocks of 64" in next(x for x in DRILLS if x.id == "quant-nf4").answer


def test_drills_the_lab_measures_point_at_registered_experiments():
    """Every "measure it" names a drill that exists, an experiment ``labkit bench ops`` runs and
    a notebook section that exists; the line is printed with the answer, in both languages."""
    import re

    from labkit.bench.ops import EXPERIMENTS as OPS
    from labkit.exercises.drills import DRILLS, format_drill
    from labkit.exercises.drills_lab import EXPERIMENTS
    from labkit.paths import REPO_ROOT

    by_id = {d.id: d for d in DRILLS}
    for drill_id, (cmd, where) in EXPERIMENTS.items():
        assert drill_id in by_id, drill_id
        name = cmd.removeprefix("labkit bench ops ")
        assert name in OPS, cmd
        nb, section = where.split(" §")
        text = (REPO_ROOT / nb).read_text()
        assert re.search(rf"## {section[0]}\. ", text), where
        assert f"measure it: {cmd}" in format_drill(by_id[drill_id])
        assert f"动手测: {cmd}" in format_drill(by_id[drill_id], lang="zh")
        assert "measure it" not in format_drill(by_id[drill_id], show_answer=False)


def test_overlap_drill_quotes_the_committed_bench_step_run():
    """The overlap drill's ratios (every cure with overlap over fused + compiled) and the
    batch-1 phases its snippet hides are the committed `labkit bench step` run's."""
    import json
    import re
    from pathlib import Path

    step = json.loads((Path(__file__).resolve().parents[2] / "datasets" / "results" /
                       "step.json").read_text())
    r = step["ratios"]
    drill = next(x for x in DRILLS if x.id == "overlap-scheduling")
    b1, b32 = (float(x) for x in re.findall(r"([\d.]+)x fused \+ compiled at batch 1 and "
                                            r"([\d.]+)x at batch 32", drill.answer)[0])
    assert b1 == round(r["batch 1"]["all"] / r["batch 1"]["fused+compiled"], 2)
    assert b32 == round(r["batch 32"]["all"] / r["batch 32"]["fused+compiled"], 2)
    row = next(x for x in step["rows"] if (x["variant"], x["batch"]) == ("fused+compiled", 1))
    hidden = re.search(r"hidden = ([\d.]+) \+ ([\d.]+)", drill.snippet).groups()
    assert [float(h) for h in hidden] == [round(row["phases_ms"][p], 3)
                                          for p in ("schedule", "detokenize")]
