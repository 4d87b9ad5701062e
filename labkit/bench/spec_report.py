"""What ``labkit bench spec`` prints and plots from its payload (kept apart from the measuring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from labkit.bench.common import print_table


def print_report(payload: dict[str, Any], SIM: dict[str, Any]) -> None:  # noqa: N803
    """The run's tables: costs per forward, measured rows, the roofline rows, draft shapes
    (``SIM``: the simulated pair, labkit.bench.spec.SIM)."""
    c = payload["costs_ms"]
    print(f"\n{payload['target']} (+ {payload['draft']}) on CPU, {payload['num_prompts']} "
          f"{payload['prompt_set']} prompts x {payload['max_tokens']} greedy tokens, "
          f"{payload['concurrency']} request(s) at a time, best of {payload['rounds']} round(s)")
    print(f"CPU ms per forward: target decode {c['target_decode_ms']:.2f}, draft decode "
          f"{c['draft_decode_ms']:.2f} (module forward {c['draft_module_decode_ms']:.2f}), "
          "target verify "
          + ", ".join(f"γ={g}: {v:.2f}" for g, v in c["target_verify_ms"].items())
          + f"; engine overhead per plain step {c['engine_overhead_per_step']:.2f}")
    print("tokens_per_s: per CPU-second of this process (= wall on an idle machine); "
          "wall_speedup: wall clock, noisy on a shared machine")
    cols = ["proposer", "gamma", "tokens_per_s", "baseline_tokens_per_s", "speedup",
            "wall_speedup", "acceptance_rate", "tokens_per_step", "predicted_speedup",
            "predicted_speedup_cpu", "outputs_match"]
    print_table([r for r in payload["results"] if r["measured"]], cols)
    print(f"\nroofline: {SIM['draft']} drafting for {SIM['target']} on {SIM['gpu']}, batch 1, "
          f"context {SIM['context']}, α as measured for the tiny draft")
    print_table([r for r in payload["results"] if not r["measured"]],
                ["gamma", "acceptance_rate", "draft_cost_c", "verify_over_decode",
                 "baseline_tokens_per_s", "tokens_per_s", "speedup"])
    print("\ndraft shapes (layers x hidden; bare forward cost c; engine costs as measured): the "
          "α each needs for 1.5x, and its speed-up at the shipped draft's α, per γ")
    print_table([{"shape": f"{r['layers']} x {r['hidden']}", "c": r["draft_cost_c"],
                  **{f"α for 1.5x γ={g}": a for g, a in r["alpha_needed"].items()},
                  **{f"at α γ={g}": v for g, v in r["speedup_at_measured_alpha"].items()}}
                 for r in payload["draft_shapes"]],
                ["shape", "c", *[f"α for 1.5x γ={g}" for g in payload["draft_shapes"][0]
                                 ["alpha_needed"]],
                 *[f"at α γ={g}" for g in payload["draft_shapes"][0]["alpha_needed"]]])


def write_chart(payload: dict[str, Any], path: str | Path,
                SIM: dict[str, Any]) -> None:  # noqa: N803
    """Measured speed-up against γ beside both predictions, and the roofline panel."""
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        f"{payload['target']} on CPU: speed-up vs plain decoding",
        f"roofline: {SIM['draft']} -> {SIM['target']} on {SIM['gpu']}"))
    for prop, color in (("ngram", "#1f77b4"), ("draft_model", "#d62728"),
                        ("eagle", "#2ca02c")):
        rows = [r for r in payload["results"] if r["proposer"] == prop]
        if not rows:
            continue
        g = [r["gamma"] for r in rows]
        for key, dash, label in (("speedup", None, "measured"),
                                 ("predicted_speedup_cpu", "dash", "predicted (CPU costs)"),
                                 ("predicted_speedup", "dot", "predicted (textbook)")):
            fig.add_scatter(x=g, y=[r[key] for r in rows], name=f"{prop} {label}", row=1, col=1,
                            line={"color": color, "dash": dash}, mode="lines+markers")
    sim = [r for r in payload["results"] if not r["measured"]]
    fig.add_scatter(x=[r["gamma"] for r in sim], y=[r["speedup"] for r in sim], row=1, col=2,
                    name="7B/1B predicted", mode="lines+markers")
    fig.update_xaxes(title_text="γ (num_speculative_tokens)")
    fig.update_yaxes(title_text="speed-up", row=1, col=1)
    fig.update_layout(title="Speculative decoding: measured and predicted")
    fig.write_html(str(path), include_plotlyjs="directory")
