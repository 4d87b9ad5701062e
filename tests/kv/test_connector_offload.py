"""The offloading connector in a real engine: greedy output equals the reference ``generate``
token for token while prefixes come back from the CPU tier, then from disk, a damaged file is
recomputed, and the tokens the model ran shrink by exactly the blocks the tiers supplied.

The workload: three 24-token "documents" (6 blocks of 4), each asked twice with a different
5-token question, one request at a time (``max_num_seqs=1``). A request needs 9 blocks and the
device pool has 12, so by the time a document comes back its blocks have been evicted from the
device: a hit can only come from a lower tier.
"""

from __future__ import annotations

import pytest
import torch

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import EngineConfigError
from labkit.kv.connector import OffloadingConnector
from labkit.kv.prefix import hash_prompt_blocks
from labkit.model import testing
from labkit.model.generate import generate

BS, NUM_BLOCKS, MAX_NEW = 4, 12, 6
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return testing.tiny_model()


@pytest.fixture(scope="module")
def docs() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 128, (24,), generator=g).tolist() for _ in range(3)]


@pytest.fixture(scope="module")
def prompts(docs) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [d + torch.randint(0, 128, (5,), generator=g).tolist() for _ in range(2) for d in docs]


@pytest.fixture(scope="module")
def reference(model, prompts) -> list[list[int]]:
    return [generate(model, p, MAX_NEW, ignore_eos=True) for p in prompts]


def engine(model, **kw) -> LLM:
    return LLM.from_model(model, block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=1, **kw)


def run(llm: LLM, prompts: list[list[int]], **kw) -> tuple[list[list[int]], int]:
    """Greedy tokens per prompt (one at a time) and the tokens the model ran for them."""
    ex = llm.llm_engine.executor
    ran = [0]
    execute = ex.execute

    def counting(out):
        ran[0] += sum(sc.num_new_tokens for sc in out.scheduled)
        return execute(out)

    ex.execute = counting
    try:
        outs = [llm.generate(prompt_token_ids=[p], sampling_params=PARAMS, use_tqdm=False,
                             **kw)[0].outputs[0].token_ids for p in prompts]
    finally:
        del ex.execute
    return [list(o) for o in outs], ran[0]


def block_bytes(model) -> int:
    c = model.config
    return 2 * c.num_hidden_layers * BS * c.num_key_value_heads * c.head_dim * 4  # float32


def found_blocks(conn: OffloadingConnector) -> int:
    """Blocks not computed: device prefix-cache hits and loads from the tiers."""
    s = conn.stats()
    return s["device"]["hits"] + s["cpu"]["loads"] + s.get("disk", {}).get("loads", 0)


def expected_ran(prompts, found: int) -> int:
    """Every prompt token minus those found, plus the MAX_NEW - 1 decode steps of each request
    (the last sampled token is never run)."""
    return sum(len(p) + MAX_NEW - 1 for p in prompts) - BS * found


def test_prefixes_come_back_from_the_cpu_tier(model, prompts, reference):
    plain_out, plain_ran = run(engine(model), prompts)
    assert plain_out == reference
    conn = OffloadingConnector(cpu_bytes=1 << 20)
    llm = engine(model, kv_connector=conn)
    out, ran = run(llm, prompts)
    assert out == reference
    s = conn.stats()
    assert s["device"]["hits"] == 0  # the device pool really is too small
    assert s["cpu"]["hits"] == s["cpu"]["loads"] == 3 * 6  # each document's 6 blocks, once
    assert s["cpu"]["bytes_loaded"] == 18 * block_bytes(model)
    assert ran == expected_ran(prompts, found_blocks(conn)) and ran == plain_ran - 18 * BS
    assert llm.llm_engine.stats()["prefix_hit_tokens"] == 0
    assert_no_leaks(llm.llm_engine)


def test_keys_are_the_prefix_cache_hashes(model, prompts):
    conn = OffloadingConnector(cpu_bytes=1 << 20)
    run(engine(model, kv_connector=conn), prompts[:1])
    p = prompts[0]
    full = (len(p) + MAX_NEW - 1) // BS  # blocks filled by the prompt and the decoded tokens
    llm = engine(model)
    llm.generate(prompt_token_ids=[p], sampling_params=PARAMS, use_tqdm=False)
    out = llm.generate(prompt_token_ids=[p], sampling_params=PARAMS, use_tqdm=False)
    tokens = p + list(out[0].outputs[0].token_ids)
    assert list(conn.store.cpu.blocks) == hash_prompt_blocks(tokens[:full * BS], BS)


def test_prefixes_come_back_from_disk_when_the_cpu_tier_is_tiny(model, prompts, reference,
                                                                 tmp_path):
    conn = OffloadingConnector(cpu_bytes=2 * block_bytes(model), disk_dir=tmp_path,
                               disk_bytes=1 << 20)
    out, ran = run(engine(model, kv_connector=conn), prompts)
    assert out == reference
    s = conn.stats()
    assert s["cpu"]["blocks"] == 2 and s["cpu"]["evictions"] > 0
    assert s["disk"]["hits"] > 0 and s["disk"]["loads"] == s["disk"]["hits"]
    assert s["cpu"]["loads"] + s["disk"]["loads"] == 18 and s["disk"]["corrupt"] == 0
    assert ran == expected_ran(prompts, found_blocks(conn))
    assert len(list(conn.store.disk.dir.glob("*.safetensors"))) == s["disk"]["blocks"]
    conn.close()
    assert not conn.store.disk.dir.exists()


def test_a_corrupt_or_truncated_file_is_recomputed(model, prompts, docs, reference, tmp_path):
    conn = OffloadingConnector(cpu_bytes=2 * block_bytes(model), disk_dir=tmp_path,
                               disk_bytes=1 << 20)
    llm = engine(model, kv_connector=conn)
    assert run(llm, prompts[:3])[0] == reference[:3]
    disk = conn.store.disk
    a0 = hash_prompt_blocks(docs[0], BS)[0]  # document A's first block: A's whole chain is lost
    b3 = hash_prompt_blocks(docs[1], BS)[3]  # document B's fourth block: B keeps 3 of 6
    assert a0 in disk and b3 in disk
    data = disk.path(a0).read_bytes()
    disk.path(a0).write_bytes(data[:-1] + bytes([data[-1] ^ 0x10]))  # one flipped bit
    disk.path(b3).write_bytes(disk.path(b3).read_bytes()[:-100])
    found_before = found_blocks(conn)
    out, ran = run(llm, prompts[3:])
    assert out == reference[3:]
    s = conn.stats()
    assert s["disk"]["corrupt"] == 2
    assert s["cpu"]["loads"] + s["disk"]["loads"] == 3 + 6  # B's first 3, all of C's
    assert ran == expected_ran(prompts[3:], found_blocks(conn) - found_before)


def test_salted_prefixes_never_cross(model, prompts, reference):
    conn = OffloadingConnector(cpu_bytes=1 << 20)
    llm = engine(model, kv_connector=conn)
    p, ref = prompts[0], reference[0]
    out = [list(llm.generate(prompt_token_ids=[p], sampling_params=PARAMS, use_tqdm=False,
                             cache_salt=salt)[0].outputs[0].token_ids)
           for salt in ("tenant-1", "tenant-2", None, "tenant-1")]
    assert out == [ref] * 4
    # only the last request hits (same salt as the first): (29 - 1) // 4 = 7 blocks, the
    # seventh filled by the first request's prompt tail and its first decoded token
    assert conn.stats()["cpu"]["hits"] == 7


def test_an_aborted_request_with_a_pending_load_frees_everything(model, prompts, tmp_path):
    conn = OffloadingConnector(cpu_bytes=block_bytes(model), disk_dir=tmp_path,
                               disk_bytes=1 << 20)
    llm = engine(model, kv_connector=conn)
    run(llm, prompts[:3])
    eng = llm.llm_engine
    eng.add_request("again", None, PARAMS, prompt_token_ids=prompts[3])
    eng.add_request("waiting", None, PARAMS, prompt_token_ids=prompts[4])
    eng.step()  # "again" loads its 6 blocks and runs its last 5 tokens; "waiting" waits
    assert conn.stats()["disk"]["loads"] + conn.stats()["cpu"]["loads"] == 6
    assert eng.abort(["again", "waiting"])
    assert_no_leaks(eng)
    assert not conn._hashes and not conn._matched and not conn._loads


def test_the_engine_without_a_connector_is_untouched(model, prompts, reference):
    llm = engine(model)
    eng = llm.llm_engine
    assert eng.kv_connector is None and eng.scheduler.connector is None
    assert eng.executor.kv_connector is None
    assert "attend" not in vars(eng.executor.kv_cache)  # the class's attend, no hook layer
    seen = []
    schedule = eng.scheduler.schedule
    eng.scheduler.schedule = lambda: seen.append(schedule()) or seen[-1]
    assert run(llm, prompts[:2])[0] == reference[:2]
    assert seen and all(o.kv_connector_metadata is None for o in seen)
    assert "kv_connector" not in eng.stats()


def test_by_name_through_kv_transfer_config(model, prompts, reference, tmp_path):
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes": 0, "disk_dir": str(tmp_path),
                                         "disk_bytes": 1 << 20}}
    llm = engine(model, kv_transfer_config=cfg)
    out, _ = run(llm, prompts)
    assert out == reference
    s = llm.llm_engine.stats()["kv_connector"]
    assert s["disk"]["loads"] == 18 and s["cpu"]["blocks"] == 0


@pytest.mark.parametrize("kw, match", [
    ({"kv_transfer_config": {"kv_connector": "lmcache"}}, "unknown kv_connector"),
    ({"kv_transfer_config": {"kv_connector": "offloading", "kv_role": "kv_producer"}},
     "kv_role"),
    ({"kv_transfer_config": {"kv_connector": "offloading", "kv_role": "both"}}, "kv_role"),
    ({"kv_transfer_config": {"kv_connector": "offloading",
                             "kv_connector_extra_config": {"cpu_byte": 10}}}, "cpu_byte"),
    ({"kv_transfer_config": {"kv_connector": "offloading"}}, "no tier"),
    ({"kv_transfer_config": {"kv_connector": "offloading",
                             "kv_connector_extra_config": {"cpu_bytes": -1}}}, ">= 0"),
    ({"kv_transfer_config": {"kv_connector": "offloading",
                             "kv_connector_extra_config": {"disk_bytes": 100}}}, "disk_dir"),
    ({"kv_transfer_config": {"connector": "offloading"}}, "unknown kv_transfer_config"),
    ({"kv_connector": "offloading",
      "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "speculative"),
    ({"kv_connector": "offloading", "kv_transfer_config": {"kv_connector": "offloading"}},
     "not both"),
])
def test_bad_connector_settings_are_named_errors(model, kw, match):
    with pytest.raises(EngineConfigError, match=match):
        engine(model, **kw)


def test_concurrent_chunked_forked_and_preempted_requests(model, prompts, reference):
    """All prompts at once, three at a time in chunks of 8 tokens, one of them with two
    greedy samples, in a pool that forces recompute preemptions: every sample still equals
    the reference, the accounting holds after every step, and nothing leaks."""
    from labkit.engine.invariants import check_kv_invariants

    conn = OffloadingConnector(cpu_bytes=1 << 20)
    llm = LLM.from_model(model, block_size=BS, num_blocks=16, max_num_seqs=3,
                         max_num_batched_tokens=8, kv_connector=conn)
    eng = llm.llm_engine
    for i, p in enumerate(prompts + prompts[:1]):
        n = 2 if i == len(prompts) else 1
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, n=n)
        eng.add_request(f"r{i}", None, params, prompt_token_ids=p)
    while eng.has_unfinished_requests():
        eng.step()
        check_kv_invariants(eng)
    outs = {rid: [list(s.output_token_ids) for s in r.seqs] for rid, r in eng.requests.items()}
    assert outs == {f"r{i}": [ref] for i, ref in enumerate(reference)} | {
        f"r{len(prompts)}": [reference[0]] * 2}
    assert eng.scheduler.num_preemptions > 0
    assert conn.stats()["cpu"]["loads"] > 0 and conn.stats()["device"]["hits"] > 0
    assert_no_leaks(eng)


def test_reset_prefix_cache_forgets_the_tiers_too(model, prompts, reference, tmp_path):
    """After new weights the same token keys name stale KV: a reset must empty every tier."""
    conn = OffloadingConnector(cpu_bytes=2 * block_bytes(model), disk_dir=tmp_path,
                               disk_bytes=1 << 20)
    llm = engine(model, kv_connector=conn)
    run(llm, prompts[:1])
    assert conn.stats()["disk"]["blocks"] > 0
    assert llm.reset_prefix_cache()
    s = conn.stats()
    assert s["cpu"]["blocks"] == s["disk"]["blocks"] == 0 == s["disk"]["bytes_used"]
    assert not list(conn.store.disk.dir.iterdir())
    assert run(llm, prompts[3:4])[0] == reference[3:4]
    assert conn.stats()["cpu"]["hits"] == conn.stats()["disk"]["hits"] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_blocks_travel_with_their_scales(model, prompts, tmp_path, kv_cache_dtype):
    """Codes and per-(token, head) scales both go to disk and back: output equals the same
    quantized engine recomputing every prefix, and a block's bytes are 2 L bs Hkv (D + 2)."""
    from labkit.kv.ops import FP8_KV_DTYPE

    if kv_cache_dtype == "fp8" and FP8_KV_DTYPE is None:
        pytest.skip("this torch has no float8_e4m3fn")
    conn = OffloadingConnector(cpu_bytes=1, disk_dir=tmp_path, disk_bytes=1 << 20)
    got, _ = run(engine(model, kv_cache_dtype=kv_cache_dtype, kv_connector=conn), prompts)
    want, _ = run(engine(model, kv_cache_dtype=kv_cache_dtype), prompts)
    assert got == want
    s, c = conn.stats(), model.config
    assert s["disk"]["loads"] == 18 and s["disk"]["corrupt"] == 0
    per_block = 2 * c.num_hidden_layers * BS * c.num_key_value_heads * (c.head_dim + 2)
    assert s["disk"]["bytes_loaded"] == 18 * per_block


def test_one_connector_object_serves_one_engine(model):
    conn = OffloadingConnector(cpu_bytes=1 << 20)
    engine(model, kv_connector=conn)
    with pytest.raises(EngineConfigError, match="already serves an engine"):
        engine(model, kv_connector=conn)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_traffic_with_aborts_keeps_the_books_and_greedy_output(model, tmp_path, seed):
    """Random arrivals sharing prefixes (two salts), n = 1 or 2, greedy or seeded sampling,
    random aborts, a tiny CPU tier over a disk tier: the KV accounting holds after every
    step, every greedy sample that finished equals the reference, and nothing leaks."""
    import random

    from labkit.engine.invariants import check_kv_invariants
    from labkit.engine.llm_engine import LLMEngine

    rng = random.Random(seed)
    conn = OffloadingConnector(cpu_bytes=3 * block_bytes(model), disk_dir=tmp_path,
                               disk_bytes=1 << 20)
    eng = LLMEngine.from_model(model, None, block_size=BS, num_blocks=14, max_num_seqs=4,
                               max_num_batched_tokens=12, kv_connector=conn)
    shared = [rng.randrange(128) for _ in range(10)]
    added = []
    while len(added) < 16 or eng.has_unfinished_requests():
        if len(added) < 16 and rng.random() < 0.5:
            prompt = (shared if rng.random() < 0.7 else []) + [
                rng.randrange(128) for _ in range(rng.randint(1, 12))]
            sp = SamplingParams(n=rng.choice([1, 1, 2]), temperature=rng.choice([0, 0, 0.8]),
                                seed=rng.randrange(100), max_tokens=rng.randint(1, 8),
                                ignore_eos=True)
            rid = f"q{len(added)}"
            eng.add_request(rid, None, sp, cache_salt=rng.choice([None, "t"]),
                            prompt_token_ids=prompt)
            added.append((rid, prompt, sp))
        if rng.random() < 0.08 and eng.requests:
            eng.abort(rng.choice(sorted(eng.requests)))
        eng.step()
        check_kv_invariants(eng)
    assert_no_leaks(eng)
    s = conn.stats()
    assert s["cpu"]["hits"] + s["disk"]["hits"] > 0
    checked = 0
    for rid, p, sp in added:
        for seq in eng.requests[rid].seqs:
            if sp.temperature == 0 and seq.finish_reason == "length":
                want = generate(model, p, sp.max_tokens, ignore_eos=True)
                assert list(seq.output_token_ids) == want, rid
                checked += 1
    assert checked >= 5
