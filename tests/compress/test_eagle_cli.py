"""`labkit distill --eagle` end to end: a few steps on a small corpus slice, a loadable head
whose card states what the log says, and an engine that runs it with the target's output."""

import json

import pytest


@pytest.mark.slow
def test_eagle_cli_writes_a_head_the_engine_runs(tmp_path):
    from labkit import LLM, SamplingParams
    from labkit.cli import main
    from labkit.model.generate import generate
    from labkit.model.loader import load_pretrained, resolve_model_path
    from labkit.train.data import prepare_data
    from labkit.train.presets import get_preset

    data = prepare_data(include=list(get_preset("smoke").include), cache_root=tmp_path / "cache",
                        tokenizer_dir=resolve_model_path("labkit-tiny"))
    out = tmp_path / "head"
    argv = ["distill", "--eagle", "--data", str(data), "--out", str(out), "--max-steps", "2",
            "--eval-every", "1", "--batch-size", "2", "--seq-len", "32", "--probe-count", "2",
            "--probe-tokens", "8", "--spec-data", "4", "--text-cache", str(tmp_path / "t.pt")]
    assert main(argv) == 0
    log = json.loads((out / "eagle_log.json").read_text())
    card = (out / "README.md").read_text()
    assert [e["step"] for e in log["eval"]] == [0, 1, 2] and log["command"] in card
    assert f"{log['eval'][-1]['top1_agreement']:.3f}" in card
    assert (tmp_path / "t.pt").is_file()
    target, tok = load_pretrained("labkit-tiny")
    prompt = tok.encode("def gcd(a, b):\n")
    llm = LLM(target, speculative_config={"method": "eagle", "model": str(out),
                                          "num_speculative_tokens": 2})
    got = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    assert got == generate(target, prompt, 12, ignore_eos=True)
