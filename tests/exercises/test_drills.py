"""Drills: every snippet runs (and its own asserts hold), the seed topics are covered, and the
`labkit drill` command behaves like an argparse CLI."""

import pytest

from labkit.exercises import drills
from labkit.exercises.drills import DRILLS, TOPICS, main, run_snippet

# The topics the seed notes (shared/seeds/README.md) ask a learner to master.
SEED_TOPICS = {
    "paged-attention", "batching", "prefix-caching", "quantization", "speculative-decoding",
    "metrics", "scheduling", "watermarks", "streaming", "rate-limiting", "gpu-sharing",
    "releases", "gateways", "autoscaling", "failover", "monitoring", "multi-tenancy", "moe",
    "llama-cpp", "tensorrt-llm", "kv-cache", "frameworks", "compression",
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
    out = run_snippet(drill)
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
    assert "1/13 exercises passed" in out and "✓ spec_speedup" in out
