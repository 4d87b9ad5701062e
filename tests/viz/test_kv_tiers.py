"""The tier views: trace_connector's record agrees with the connector's own counters, and the
widget's tiers after a workload equal the connector's stats (hits climb only when prefixes
come back)."""

from __future__ import annotations

import torch

from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.kv.connector import OffloadingConnector
from labkit.model import testing
from labkit.viz.kv_tiers import KVTierWidget, connector_table, trace_connector


def _engine(tmp_path):
    model = testing.tiny_model()
    probe = LLM.from_model(model, block_size=4, num_blocks=12)
    per_block = probe.llm_engine.config.cache.bytes_per_block
    conn = OffloadingConnector(cpu_bytes=4 * per_block, disk_dir=tmp_path,
                               disk_bytes=64 * per_block)
    return LLM.from_model(model, block_size=4, num_blocks=12, max_num_seqs=1, kv_connector=conn)


def _requests():
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 128, (24,), generator=g).tolist() for _ in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    return [(d + [q], sp) for q in (1, 2) for d in docs]


def test_trace_matches_the_connector_counters(tmp_path):
    llm = _engine(tmp_path)
    conn = llm.llm_engine.kv_connector
    log = trace_connector(conn)
    for ids, sp in _requests():
        llm.generate(prompt_token_ids=[ids], sampling_params=sp)
    admits = [e for e in log if e["kind"] == "admit"]
    loads = [t for e in log if e["kind"] == "step" for _, t in e["loads"]]
    stats = conn.stats()
    assert len(admits) == 6 and sum(e["matched"] for e in admits) == 4 * len(loads)
    assert loads.count("cpu") == stats["cpu"]["loads"] and loads.count("disk") == \
        stats["disk"]["loads"]
    assert [e["matched"] for e in admits][:3] == [0, 0, 0] and len(loads) > 0
    lines = connector_table(log, 4)
    assert lines[0].startswith("admit") and any("<-disk" in x or "<-cpu" in x for x in lines)


def test_widget_history_follows_the_tiers(tmp_path):
    llm = _engine(tmp_path)
    w = KVTierWidget(llm, _requests())
    w.run(3)
    assert all(v == 0 for k, v in w.history[-1]["hit_tokens"].items() if k != "device")
    w.run(10)  # runs the 3 left, no more
    assert w.done == 6 and len(w.history) == 6
    stats = llm.llm_engine.kv_connector.stats()
    last = w.history[-1]
    assert last["blocks"]["cpu"] == stats["cpu"]["blocks"]
    assert last["hit_tokens"]["cpu"] + last["hit_tokens"]["disk"] == \
        4 * (stats["cpu"]["hits"] + stats["disk"]["hits"]) > 0
    assert len(w.figure.data) == 1 + len(last["hit_tokens"])
