"""The KV-connector seam, scheduler side, with a fake connector; and the offloading tiers alone.

The fake claims a fixed number of external tokens per request; the expected calls, block ids,
chunk starts and token counts are worked out by hand from the block size (4) and the prompts.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from labkit.config import SchedulerConfig
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import KVConnectorError
from labkit.kv.block_manager import BlockManager
from labkit.kv.connector import KVConnectorBase, KVConnectorMetadata
from labkit.kv.connector.tiers import CPUTier, TieredStore, payload_nbytes
from labkit.kv.prefix import hash_prompt_blocks
from labkit.sched.request import Request
from labkit.sched.scheduler import Scheduler

BS = 4


class FakeConnector(KVConnectorBase):
    """Claims ``claims[request_id]`` external tokens and records every call."""

    def __init__(self, claims: dict[str, int]) -> None:
        super().__init__()
        self.claims = claims
        self.calls: list[tuple] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self.calls.append(("match", request.seq_id, num_computed_tokens))
        return self.claims.get(request.seq_id, 0)

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self.calls.append(("alloc", request.seq_id, list(blocks), num_external_tokens,
                           request.num_computed_tokens))

    def build_connector_meta(self, scheduler_output):
        meta = KVConnectorMetadata()
        self.calls.append(("meta", [(sc.seq.seq_id, sc.start_pos, sc.num_new_tokens)
                                    for sc in scheduler_output.scheduled], meta))
        return meta

    def request_finished(self, request, block_ids):
        self.calls.append(("finished", request.seq_id, list(block_ids)))

    def register_kv_caches(self, kv_cache):
        raise AssertionError("the scheduler never calls the worker side")

    def start_load_kv(self):
        raise AssertionError("the scheduler never calls the worker side")

    def wait_for_save(self):
        raise AssertionError("the scheduler never calls the worker side")


def make(claims: dict[str, int], num_blocks: int = 16) -> tuple[Scheduler, FakeConnector]:
    conn = FakeConnector(claims)
    bm = BlockManager(num_blocks, BS)
    return Scheduler(SchedulerConfig(), bm, lambda: 0.0, kv_connector=conn), conn


def request(rid: str, tokens: list[int], max_tokens: int = 1) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, tokens, params, 0.0, index=next(_INDEX))  # index: the queue tie-break


_INDEX = itertools.count()


def run_to_end(sched: Scheduler) -> None:
    while sched.has_unfinished():
        out = sched.schedule()
        sched.update_from_output(out, {sc.seq.seq_id: [7] for sc in out.scheduled if sc.samples})


def test_external_tokens_get_their_own_fresh_blocks_and_count_as_computed():
    sched, conn = make({"a": 8})
    req = request("a", list(range(13)))
    sched.add_request(req)
    out = sched.schedule()
    seq = req.seqs[0]
    assert len(seq.block_table) == 4  # ceil(13 / 4): loaded and computed tokens alike
    match, alloc, meta = conn.calls
    assert match == ("match", "a", 0)
    # the first two blocks, allocated for the connector, before they count as computed
    assert alloc == ("alloc", "a", seq.block_table[:2], 8, 0)
    assert meta[:2] == ("meta", [("a", 8, 5)])  # the chunk starts after the loaded tokens
    assert out.kv_connector_metadata is meta[2]
    assert seq.num_computed_tokens == 8 and seq.num_cached_tokens == 8
    assert out.num_batched_tokens == 5


def test_the_connector_is_asked_after_the_device_prefix_hit():
    sched, conn = make({"b": 4})
    first = request("a", list(range(13)))
    sched.add_request(first)
    run_to_end(sched)  # publishes blocks 0..2 (tokens 0..11) in the device prefix cache
    published = [sched.bm.pool.lookup(h) for h in hash_prompt_blocks(list(range(12)), BS)]
    assert None not in published
    conn.calls.clear()
    second = request("b", list(range(12)) + [99, 98, 97, 96, 95])  # 17 tokens
    sched.add_request(second)
    out = sched.schedule()
    seq = second.seqs[0]
    assert conn.calls[0] == ("match", "b", 12)  # 3 cached blocks
    assert seq.block_table[:3] == published
    assert conn.calls[1] == ("alloc", "b", [seq.block_table[3]], 4, 12)
    assert out.scheduled[0].start_pos == 16 and out.scheduled[0].num_new_tokens == 1
    assert seq.num_cached_tokens == 16


def test_finish_and_abort_tell_the_connector_which_blocks_are_freed():
    sched, conn = make({})
    a, b = request("a", list(range(6))), request("b", list(range(20, 27)), max_tokens=5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    tables = {sc.seq.seq_id: list(sc.seq.block_table) for sc in out.scheduled}
    sched.update_from_output(out, {"a": [7], "b": [7]})  # a ends (max_tokens 1), b goes on
    sched.abort_request(b)
    finished = [c for c in conn.calls if c[0] == "finished"]
    assert finished == [("finished", "a", tables["a"]), ("finished", "b", tables["b"])]
    assert sched.bm.pool.num_used == 0


@pytest.mark.parametrize("claim", [6, 12, 16, -4, 4.0])
def test_a_connector_breaking_the_contract_is_stopped_before_any_allocation(claim):
    """6: a partial block; 12 of a 12-token prompt: the last token too; 16: more than the
    prompt; -4, 4.0: not a token count. A 12-token prompt may take at most 8."""
    sched, _ = make({"a": claim})
    sched.add_request(request("a", list(range(12))))
    with pytest.raises(KVConnectorError, match="whole blocks"):
        sched.schedule()
    assert sched.bm.pool.num_used == 0


def test_the_largest_legal_claim_leaves_one_token_to_compute():
    sched, conn = make({"a": 8})
    sched.add_request(request("a", list(range(12))))
    out = sched.schedule()
    assert out.scheduled[0].num_new_tokens == 4  # block 2 in full: only whole blocks load


def test_without_a_connector_the_output_carries_no_metadata():
    bm = BlockManager(16, BS)
    sched = Scheduler(SchedulerConfig(), bm, lambda: 0.0)
    sched.add_request(request("a", list(range(13))))
    out = sched.schedule()
    assert sched.connector is None and out.kv_connector_metadata is None
    assert out.scheduled[0].start_pos == 0 and out.num_batched_tokens == 13


# ---- the tiers ---------------------------------------------------------------------------------
LAYOUT = {"k": ((2, BS, 1, 2), torch.float32), "v": ((2, BS, 1, 2), torch.float32)}


def payload(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=g, dtype=dt) for n, (shape, dt) in LAYOUT.items()}


def test_payload_bytes_by_hand():
    assert payload_nbytes(payload(0)) == 2 * (2 * BS * 1 * 2) * 4  # K and V, float32


def test_cpu_tier_is_an_lru_capped_in_bytes():
    one = payload_nbytes(payload(0))
    tier = CPUTier(2 * one)
    assert tier.put(b"a", payload(1)) == [] and tier.put(b"b", payload(2)) == []
    assert tier.get(b"a") is not None  # a is now the most recent: b goes first
    evicted = tier.put(b"c", payload(3))
    assert [k for k, _ in evicted] == [b"b"] and set(tier.blocks) == {b"a", b"c"}
    assert tier.bytes_used == 2 * one and tier.counters["evictions"] == 1
    assert [k for k, _ in CPUTier(one - 1).put(b"x", payload(4))] == [b"x"]  # too big: back


def test_store_spills_cpu_evictions_to_disk_and_disk_evicts_files(tmp_path):
    one = payload_nbytes(payload(0))
    store = TieredStore(one, LAYOUT, tmp_path, disk_bytes=1 << 20)
    file_size = None
    for i in range(3):
        store.put(bytes([i]) * 32, payload(i))
    assert list(store.cpu.blocks) == [bytes([2]) * 32]
    assert list(store.disk.files) == [bytes([0]) * 32, bytes([1]) * 32]
    tier, p = store.get(bytes([0]) * 32)
    assert tier == "disk" and all(torch.equal(p[n], payload(0)[n]) for n in LAYOUT)
    file_size = store.disk.files[bytes([0]) * 32]
    assert store.disk.path(bytes([0]) * 32).stat().st_size == file_size
    small = TieredStore(0, LAYOUT, tmp_path, disk_bytes=2 * file_size)  # disk only, 2 files
    for i in range(3):
        small.put(bytes([i]) * 32, payload(i))
    assert list(small.disk.files) == [bytes([1]) * 32, bytes([2]) * 32]
    assert not small.disk.path(bytes([0]) * 32).exists()
    assert small.disk.counters["evictions"] == 1
    small.close()
    assert not small.disk.dir.exists()


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap", "delete"])
def test_a_damaged_file_is_a_miss_and_is_dropped(tmp_path, damage):
    store = TieredStore(0, LAYOUT, tmp_path, disk_bytes=1 << 20)
    ka, kb = b"a" * 32, b"b" * 32
    store.put(ka, payload(1))
    store.put(kb, payload(2))
    path = store.disk.path(ka)
    data = bytearray(path.read_bytes())
    if damage == "flip":  # one bit of the last float
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-9]))
    elif damage == "swap":  # b's (valid) file under a's name: its key says b
        path.write_bytes(store.disk.path(kb).read_bytes())
    else:
        path.unlink()
    assert store.get(ka) is None
    assert store.disk.counters["corrupt"] == 1 and ka not in store.disk
    assert not path.exists()
    assert store.get(kb)[0] == "disk"  # the other file is fine
