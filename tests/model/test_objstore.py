"""Checkpoints from a real S3 API on loopback (moto's server): every way of loading gives the
local folder's exact tensors, and a broken or changed object is a named error."""

from __future__ import annotations

import json
import shutil
import struct

import pytest
import torch

pytest.importorskip("boto3", reason="the objstore extra (boto3) is not installed")
pytest.importorskip("moto", reason="the objstore extra (moto) is not installed")

from labkit.bench.s3_loopback import S3Loopback  # noqa: E402
from labkit.model.loader import CheckpointError, load_pretrained, resolve_model_path  # noqa: E402
from labkit.model.objstore import S3Source, fetch_checkpoint  # noqa: E402
from labkit.model.objstore_stream import load_streaming  # noqa: E402

PART = 256 << 10  # small parts: labkit-tiny's 10 MB becomes ~40 ranged GETs


@pytest.fixture(scope="module")
def s3():
    with S3Loopback() as server:
        server.uri = server.upload_folder(resolve_model_path("labkit-tiny"), "models", "tiny")
        yield server


@pytest.fixture(scope="module")
def reference():
    model, _ = load_pretrained("labkit-tiny")
    return model.state_dict()


def _src(s3, tmp_path, uri=None, **kw) -> S3Source:
    return S3Source(uri or s3.uri, endpoint_url=s3.endpoint_url, cache_dir=tmp_path / "cache",
                    part_size=PART, **kw)


def _same(model, reference) -> bool:
    got = model.state_dict()
    return got.keys() == reference.keys() and all(torch.equal(got[k], reference[k])
                                                  for k in reference)


@pytest.mark.parametrize("mode", ["sequential", "ranged"])
def test_fetch_then_load_equals_local(s3, tmp_path, reference, mode):
    folder = fetch_checkpoint(_src(s3, tmp_path), mode)
    local = resolve_model_path("labkit-tiny") / "model.safetensors"
    assert (folder / "model.safetensors").read_bytes() == local.read_bytes()
    model, tok = load_pretrained(folder)
    assert _same(model, reference) and tok is not None


def test_streaming_equals_local(s3, tmp_path, reference):
    model, tok = load_streaming(_src(s3, tmp_path))
    assert _same(model, reference)
    assert tok.encode("def f(x):") == load_pretrained("labkit-tiny")[1].encode("def f(x):")


def test_cache_hit_fetches_nothing_and_a_changed_object_refetches(s3, tmp_path, monkeypatch):
    src = _src(s3, tmp_path)
    fetch_checkpoint(src)
    import labkit.model.objstore as objstore

    calls = []
    real = objstore.get_range
    monkeypatch.setattr(objstore, "get_range", lambda *a, **k: calls.append(a) or real(*a, **k))
    fetch_checkpoint(src)
    assert calls == []  # the manifest matched the listing: a disk read, no GET
    c = s3.client()
    c.put_object(Bucket="models", Key="tiny/generation_config.json", Body=b'{"changed": 1}')
    try:
        folder = fetch_checkpoint(src)
        assert calls and json.loads((folder / "generation_config.json").read_text()) == \
            {"changed": 1}
    finally:
        c.upload_file(str(resolve_model_path("labkit-tiny") / "generation_config.json"),
                      "models", "tiny/generation_config.json")


def _upload_variant(s3, tmp_path, prefix, mutate) -> str:
    folder = tmp_path / prefix
    shutil.copytree(resolve_model_path("labkit-tiny"), folder)
    mutate(folder / "model.safetensors")
    return s3.upload_folder(folder, "models", prefix)


def test_truncated_object_is_rejected_by_every_path(s3, tmp_path):
    def cut(f):
        f.write_bytes(f.read_bytes()[:-1000])

    uri = _upload_variant(s3, tmp_path, "truncated", cut)
    for mode in ("sequential", "ranged"):
        with pytest.raises(CheckpointError, match="truncated"):
            fetch_checkpoint(_src(s3, tmp_path / mode, uri), mode)
    with pytest.raises(CheckpointError, match="truncated"):
        load_streaming(_src(s3, tmp_path, uri))


def test_tensor_that_does_not_fit_the_config_is_named(s3, tmp_path):
    def bigger_vocab(f):
        raw = f.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        header["model.embed_tokens.weight"]["shape"][0] -= 1  # a mismatched upload
        new = json.dumps(header, separators=(",", ":")).encode().ljust(n)
        f.write_bytes(raw[:8] + new + raw[8 + n:])

    uri = _upload_variant(s3, tmp_path, "mismatched", bigger_vocab)
    with pytest.raises(CheckpointError, match="embed_tokens"):
        load_streaming(_src(s3, tmp_path, uri))


def test_object_changed_mid_load_is_named(s3, tmp_path, monkeypatch):
    import labkit.model.objstore as objstore

    real = objstore.list_checkpoint

    def stale_listing(src, client):
        listing = real(src, client)
        size, _ = listing["model.safetensors"]
        listing["model.safetensors"] = (size, '"0123456789abcdef0123456789abcdef"')
        return listing

    monkeypatch.setattr(objstore, "list_checkpoint", stale_listing)
    with pytest.raises(CheckpointError, match="changed while it was being loaded"):
        fetch_checkpoint(_src(s3, tmp_path))


def test_not_a_checkpoint_and_bad_uris(s3, tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        fetch_checkpoint(_src(s3, tmp_path, "s3://models/nothing-here"))
    with pytest.raises(CheckpointError, match="names no bucket"):
        S3Source("s3:///x")


def test_model_flag_accepts_s3_uri_with_the_usual_endpoint_setting(s3, tmp_path, monkeypatch,
                                                                   reference):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("LABKIT_S3_CACHE", str(tmp_path / "node-cache"))
    model, _ = load_pretrained(s3.uri)
    assert _same(model, reference)
    assert (tmp_path / "node-cache" / "models" / "tiny" / "model.safetensors").is_file()


def test_labkit_serve_loads_an_s3_uri(s3, tmp_path, monkeypatch):
    """``labkit serve s3://...`` with the endpoint in AWS_ENDPOINT_URL: the served greedy text
    equals the local model's."""
    import httpx

    from labkit import LLM, SamplingParams
    from labkit.serve.process import ServerProcess

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)
    monkeypatch.setenv("LABKIT_S3_CACHE", str(tmp_path / "serve-cache"))
    want = LLM("labkit-tiny", dtype="float32").generate(
        ["def f(x):"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    with ServerProcess(s3.uri, ["--dtype", "float32"]) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": s3.uri, "prompt": "def f(x):", "max_tokens": 8,
                             "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
