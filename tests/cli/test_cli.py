"""`labkit` command line: info, generate (against the reference decoder), errors, dispatch."""

import pytest

from labkit.cli import main


def test_info_lists_versions_and_shipped_models(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for line in ("torch", "triton", "transformers", "device", "models"):
        assert line in out
    assert "labkit-tiny" in out


def test_generate_streams_the_reference_greedy_completion(capsys):
    from labkit.model.generate import generate
    from labkit.model.loader import load_pretrained

    prompt = "def fibonacci(n):"
    assert main(["generate", "--max-tokens", "12", prompt]) == 0
    printed = capsys.readouterr().out
    model, tok = load_pretrained("labkit-tiny")
    ids = generate(model, tok.encode(prompt), 12)
    ids = ids[:next((i for i, t in enumerate(ids) if t in model.config.eos_token_ids), len(ids))]
    assert printed == prompt + tok.decode(ids) + "\n"


@pytest.mark.parametrize("argv,message", [
    (["generate", "--temperature", "-1", "hi"], "temperature"),
    (["generate", "--max-tokens", "0", "hi"], "--max-tokens"),
    (["generate", ""], "PROMPT is empty"),
    (["generate", "--model", "/no/such/model", "hi"], "no/such/model"),
    (["bench", "nope"], "unknown benchmark"),
])
def test_bad_arguments_exit_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bench_dispatches_to_the_benchmark(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "memory", "--help"])
    assert e.value.code == 0 and "labkit bench memory" in capsys.readouterr().out


def test_the_readme_example_repeats_a_line_as_the_readme_warns(capsys):
    """The README's first `labkit generate` prints a line over and over and says why (a 5 M
    parameter model, greedy): the warning must stay true of what a newcomer sees."""
    from labkit.cli import main

    assert main(["generate", "--model", "labkit-tiny", "--max-tokens", "40",
                 "def fibonacci(n):"]) == 0
    lines = [x.strip() for x in capsys.readouterr().out.splitlines() if x.strip()]
    assert max(lines.count(x) for x in set(lines)) >= 3, lines
