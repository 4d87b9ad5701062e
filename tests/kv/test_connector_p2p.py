"""Prefill/decode disaggregation between two engines in one process, over a loopback socket.

The prefill engine (``kv_producer``) runs each prompt with ``max_tokens=1`` and pushes its full
blocks to the decode engine (``kv_consumer``) when the request finishes; the decode engine then
runs the same prompt and must (1) give the reference ``generate``'s greedy tokens, (2) compute
only the tokens past the pushed blocks, and (3) leak no block on either side. Then the faults:
a decode instance that is gone, a frame for another model / layout, a corrupt or oversize frame
(each refused, nothing stored, the request recomputed and still right).
"""

from __future__ import annotations

import socket

import pytest
import torch

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import KVConnectorError, SamplingParamsError
from labkit.kv.connector import P2PConsumer, P2PProducer
from labkit.kv.connector.transfer import decode_frame, encode_frame, send_blocks
from labkit.model import testing
from labkit.model.generate import generate

BS, MAX_NEW = 4, 6


@pytest.fixture(scope="module")
def model():
    return testing.tiny_model()


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (23, 9, 16)]


def make_producer(model) -> LLM:
    return LLM.from_model(model, block_size=BS, num_blocks=32,
                          kv_transfer_config={"kv_connector": P2PProducer(model="tiny"),
                                              "kv_role": "kv_producer"})


def make_consumer(model, **kw) -> LLM:
    return LLM.from_model(model, block_size=BS, num_blocks=32,
                          kv_transfer_config={"kv_connector": P2PConsumer(model="tiny", **kw),
                                              "kv_role": "kv_consumer"})


def prefill_params(port: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, kv_transfer_params={
        "do_remote_decode": True, "remote_host": "127.0.0.1", "remote_port": port})


def ran_tokens(llm: LLM, fn):
    ex, ran = llm.llm_engine.executor, [0]
    execute = ex.execute

    def counting(out):
        ran[0] += sum(sc.num_new_tokens for sc in out.scheduled)
        return execute(out)

    ex.execute = counting
    try:
        return fn(), ran[0]
    finally:
        del ex.execute


def test_pd_pair_equals_reference_and_decode_skips_the_pushed_blocks(model, prompts):
    prefill, decode = make_producer(model), make_consumer(model)
    consumer = decode.llm_engine.kv_connector
    try:
        decode_sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        for p in prompts:
            prefill.generate(prompt_token_ids=[p], sampling_params=prefill_params(consumer.port),
                             use_tqdm=False)
            out, ran = ran_tokens(decode, lambda p=p: decode.generate(
                prompt_token_ids=[p], sampling_params=decode_sp, use_tqdm=False))
            assert out[0].outputs[0].token_ids == generate(model, p, MAX_NEW, ignore_eos=True)
            pushed = (len(p) - 1) // BS * BS
            assert ran == len(p) - pushed + MAX_NEW - 1  # the rest of the prompt + decodes
        push = prefill.llm_engine.kv_connector.stats()["push"]
        assert push["failed"] == 0 and push["requests"] == len(prompts)
        assert push["blocks"] == sum((len(p) - 1) // BS for p in prompts)
        assert consumer.stats()["receive"]["blocks"] == push["blocks"]
        for llm in (prefill, decode):
            assert_no_leaks(llm.llm_engine)
    finally:
        consumer.close()


def test_decode_instance_gone_fails_the_push_cleanly_and_frees_the_blocks(model, prompts):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    prefill = make_producer(model)
    out = prefill.generate(prompt_token_ids=[prompts[0]], sampling_params=prefill_params(dead),
                           use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 1  # the prefill itself still answers
    c = prefill.llm_engine.kv_connector
    assert c.stats()["push"]["failed"] == 1
    assert not next(iter(c.results.values()))["ok"]
    assert_no_leaks(prefill.llm_engine)


def test_a_lost_transfer_is_recomputed_not_wrong(model, prompts):
    decode = make_consumer(model)
    try:
        sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
        p = prompts[0]
        out, ran = ran_tokens(decode, lambda p=p: decode.generate(prompt_token_ids=[p],
                                                              sampling_params=sp,
                                                              use_tqdm=False))
        assert out[0].outputs[0].token_ids == generate(model, p, MAX_NEW, ignore_eos=True)
        assert ran == len(p) + MAX_NEW - 1  # nothing arrived: the whole prompt computed
    finally:
        decode.llm_engine.kv_connector.close()


def _frame_for(model, prompt, name="tiny"):
    """A real frame: pushed by a producer engine into a capturing fake socket."""
    llm = make_producer(model)
    c = llm.llm_engine.kv_connector
    c.model = name
    captured = {}
    import labkit.kv.connector.p2p as p2p

    def capture(host, port, frame, timeout_s):
        captured["frame"] = frame
        return 0

    orig = p2p.send_blocks
    p2p.send_blocks = capture
    try:
        llm.generate(prompt_token_ids=[prompt], sampling_params=prefill_params(9), use_tqdm=False)
    finally:
        p2p.send_blocks = orig
    return captured["frame"], c.layout


@pytest.mark.parametrize("damage", ["model", "checksum", "truncated", "oversize", "header"])
def test_receiver_refuses_bad_frames_and_stores_nothing(model, prompts, damage):
    frame, layout = _frame_for(model, prompts[0], "other" if damage == "model" else "tiny")
    decode = make_consumer(model, max_frame_bytes=len(frame) - 1 if damage == "oversize"
                           else 1 << 24)
    c = decode.llm_engine.kv_connector
    if damage == "checksum":
        frame = frame[:-1] + bytes([frame[-1] ^ 1])
    elif damage == "truncated":
        frame = frame[:-10]
    elif damage == "header":
        frame = frame[:8] + b"{not json" + frame[17:]
    try:
        with pytest.raises((KVConnectorError, OSError)):
            send_blocks("127.0.0.1", c.port, frame, timeout_s=5.0)
        assert c.stats()["receive"]["refused"] == 1 and c.stats()["receive"]["blocks"] == 0
        assert len(c.store.tiers()[0].blocks) == 0
    finally:
        c.close()


def test_frame_round_trips_bit_exact(model, prompts):
    frame, layout = _frame_for(model, prompts[0])
    pos = [0]

    def read(n):
        pos[0] += n
        return frame[pos[0] - n:pos[0]]

    blocks = decode_frame(read, "tiny", layout, 1 << 24)
    assert len(blocks) == (len(prompts[0]) - 1) // BS
    again = encode_frame("tiny", layout, blocks)
    assert again == frame


def test_bad_kv_transfer_params_are_named():
    with pytest.raises(SamplingParamsError, match="kv_transfer_params"):
        SamplingParams(kv_transfer_params=["not", "a", "dict"])


def _server(behaviour):
    """A loopback listener that accepts one connection and misbehaves: ``"silent"`` reads
    everything and never answers, ``"hangup"`` reads a few bytes and closes (a decode
    instance dying mid-transfer)."""
    import threading
    import time

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve():
        conn, _ = srv.accept()
        with conn:
            if behaviour == "hangup":
                conn.recv(16)
                linger_0 = b"\x01\x00\x00\x00\x00\x00\x00\x00"  # close with a reset
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger_0)
                return
            while conn.recv(1 << 16):
                pass
            time.sleep(3)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, t


@pytest.mark.parametrize("behaviour", ["silent", "hangup"])
def test_push_that_times_out_or_is_cut_fails_cleanly(model, prompts, behaviour):
    srv, t = _server(behaviour)
    try:
        prefill = LLM.from_model(model, block_size=BS, num_blocks=32, kv_transfer_config={
            "kv_connector": P2PProducer(model="tiny", timeout_s=0.5), "kv_role": "kv_producer"})
        out = prefill.generate(prompt_token_ids=[prompts[0]],
                               sampling_params=prefill_params(srv.getsockname()[1]))
        assert len(out[0].outputs[0].token_ids) == 1
        c = prefill.llm_engine.kv_connector
        assert c.stats()["push"]["failed"] == 1 and c.stats()["push"]["blocks"] == 0
        assert_no_leaks(prefill.llm_engine)
    finally:
        srv.close()
        t.join(timeout=5)


def test_a_remote_decode_without_an_address_is_refused_at_construction():
    with pytest.raises(SamplingParamsError, match="remote_host"):
        SamplingParams(kv_transfer_params={"do_remote_decode": True, "remote_port": 9000})
    with pytest.raises(SamplingParamsError, match="1..65535"):
        SamplingParams(kv_transfer_params={"do_remote_decode": True, "remote_host": "h",
                                           "remote_port": 0})
    assert SamplingParams(kv_transfer_params={"do_remote_decode": False}).kv_transfer_params
