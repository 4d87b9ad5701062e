"""labkit bench gguf's parts, without llama.cpp: the load-time helpers, labkit's timing, the
llama.cpp runner's named errors (missing install, a crashed worker), the chart, and the
`labkit export gguf` command on a tiny checkpoint with a tokenizer."""

import os
import stat

import pytest

from labkit.bench import gguf as bench
from labkit.bench.llamacpp import LlamaCppCrashed, LlamaCppUnavailable, run_llamacpp

pytest.importorskip("gguf")


def test_load_helpers(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(os.urandom(1 << 20))
    assert isinstance(bench.drop_page_cache(f), bool)
    for mode in ("mmap", "read"):
        assert bench.bytes_in(f, mode) > 0


def test_export_cli_and_labkit_timing(tiny_ckpt, tmp_path, capsys):
    from labkit.cli import main
    from labkit.model.loader import load_pretrained

    out = tmp_path / "tiny.gguf"
    assert main(["export", "gguf", str(tiny_ckpt), str(out), "--type", "q8_0"]) == 0
    assert "q8_0" in capsys.readouterr().out
    model, tok = load_pretrained(out)
    ref_model, ref_tok = load_pretrained(tiny_ckpt)
    assert tok.encode("def f(x): return x") == ref_tok.encode("def f(x): return x")
    ids = bench.prompt_ids(tok, 16)
    assert len(ids) == 16 and ids[0] == tok.bos_token_id
    r = bench.labkit_speed(model, ids, 4, 1)
    assert r["ttft_ms"] > 0 and r["decode_tok_s"] > 0


def test_runner_names_a_missing_install_and_a_crash(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_LLAMACPP_PYTHON", str(tmp_path / "no-such-python"))
    with pytest.raises(LlamaCppUnavailable, match="run_llamacpp.sh"):
        run_llamacpp({"tasks": []})
    crasher = tmp_path / "segv"
    crasher.write_text("#!/bin/sh\nkill -SEGV $$\n")
    crasher.chmod(crasher.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(LlamaCppCrashed) as e:
        run_llamacpp({"model": "m.gguf", "tasks": []}, python=str(crasher))
    assert e.value.signal == "SIGSEGV"


def test_chart(tmp_path):
    pytest.importorskip("plotly")
    payload = {"config": {"threads": 2},
               "speed": [{"engine": "labkit", "format": "fp32", "ttft_ms": 5.0,
                          "decode_tok_s": 100.0},
                         {"engine": "llama.cpp", "format": "q8_0 gguf", "error": "SIGSEGV"}],
               "load": [{"what": "bytes in (mmap)", "file": "gguf f32", "cache": c, "ms": 1.0,
                         "MB": 2.0} for c in ("cold", "warm")]}
    bench.write_chart(payload, tmp_path / "gguf.html")
    assert (tmp_path / "gguf.html").stat().st_size > 1000
