"""Controls that re-run the simulator (or the tiny engine) and update the widgets in place.

The point of a lab is to turn a knob and see what moves: halve the block size and watch
fragmentation drop, raise the arrival rate until TTFT's p99 explodes, switch batching to static
and watch the Gantt chart fill with idle slots. `SimulatorControls` drives `labkit.engine.
simulate` (the real scheduler and block manager with a roofline cost model of a named GPU and
model); `SpecControls` re-runs the real tiny engine with speculative decoding for a chosen γ.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets

from labkit.viz.latency import LatencyWidget
from labkit.viz.memory import MemoryWidget
from labkit.viz.page_table import PageTableWidget
from labkit.viz.schedule import ScheduleWidget
from labkit.viz.spec import SpecWidget


def _metrics_html(metrics: dict, stats: dict | None = None) -> str:
    def ms(key: str, q: str) -> str:
        v = metrics[key].get(q)
        return "–" if v is None else f"{v * 1e3:,.1f}"

    tps = metrics.get("tokens_per_s")
    head = (f"<b>{metrics['num_finished']}/{metrics['num_requests']}</b> requests finished, "
            f"{metrics['output_tokens']:,} output tokens in {metrics['duration_s']:.2f} s "
            f"(simulated): <b>{'–' if tps is None else f'{tps:,.0f}'} tokens/s</b>")
    if stats and "num_preemptions" in stats:
        head += f", {stats['num_preemptions']} preemptions"
    rows = "".join(f"<tr><td>{k.upper()}</td><td>{ms(k, 'mean')}</td><td>{ms(k, 'p50')}</td>"
                   f"<td>{ms(k, 'p90')}</td><td>{ms(k, 'p99')}</td></tr>"
                   for k in ("ttft", "tpot", "e2e", "queue"))
    return (f"<div>{head}</div><table><tr><th>ms</th><th>mean</th><th>p50</th><th>p90</th>"
            f"<th>p99</th></tr>{rows}</table>")


class SimulatorControls(widgets.VBox):
    """Knobs for `simulate()` and tabs of widgets that follow every run.

    Changing a control re-runs the simulation when `auto` is ticked (else press Run). Extra
    keyword arguments are passed to `simulate` unchanged (e.g. `kv_cache_bytes`).
    """

    def __init__(self, model: str = "llama-2-7b", gpu: str = "a100-80gb",
                 workload: str = "chat", num_requests: int = 100,
                 arrival_rate: float = 0.0, block_size: int = 16,
                 max_num_batched_tokens: int = 2048, policy: str = "fcfs",
                 enable_prefix_caching: bool = True, batching: str = "continuous",
                 seed: int = 0, auto: bool = True, run: bool = True, **simulate_kw: Any) -> None:
        self.simulate_kw, self.seed = simulate_kw, seed
        style = {"description_width": "170px"}
        wide = widgets.Layout(width="420px")
        self._add_workload_knobs(style, wide, model, gpu, workload, num_requests, arrival_rate)
        self._add_engine_knobs(style, wide, block_size, max_num_batched_tokens, policy,
                               enable_prefix_caching, batching)
        self.auto = widgets.Checkbox(value=auto, description="re-run on change")
        self.run_button = widgets.Button(description="Run", button_style="primary")
        self.status = widgets.HTML()
        self.progress = widgets.Output()  # tqdm's notebook bar lands here during a run
        self.metrics = widgets.HTML()
        self.controls = [self.model, self.gpu, self.workload, self.num_requests,
                         self.arrival_rate, self.block_size, self.chunk, self.policy,
                         self.prefix, self.batching]
        for c in self.controls:
            c.observe(self._changed, names="value")
        self.run_button.on_click(lambda _: self.run())
        self.tabs = widgets.Tab()
        self.result: Any = None
        self.schedule = self.memory = self.latency = self.page_table = None
        box = widgets.VBox(self.controls[:5])
        box2 = widgets.VBox(self.controls[5:] + [widgets.HBox([self.run_button, self.auto])])
        super().__init__([widgets.HBox([box, box2]), self.status, self.progress, self.metrics,
                          self.tabs])
        self.add_class("labkit-simcontrols")
        if run:
            self.run()

    def _add_workload_knobs(self, style: dict, wide: widgets.Layout, model: str, gpu: str,
                            workload: str, num_requests: int, arrival_rate: float) -> None:
        """The left column: what is served, on what, and how fast requests come."""
        from labkit.sim.presets import GPUS, MODELS
        from labkit.sim.workloads import WORKLOADS

        self.model = widgets.Dropdown(options=list(MODELS), value=model, description="model",
                                      style=style, layout=wide)
        self.gpu = widgets.Dropdown(options=list(GPUS), value=gpu, description="GPU",
                                    style=style, layout=wide)
        self.workload = widgets.Dropdown(options=list(WORKLOADS), value=workload,
                                         description="workload", style=style, layout=wide)
        self.num_requests = widgets.IntSlider(value=num_requests, min=1, max=1000,
                                              description="requests", style=style, layout=wide)
        self.arrival_rate = widgets.FloatSlider(value=arrival_rate, min=0.0, max=50.0, step=0.5,
                                                description="arrivals/s (0 = burst)",
                                                style=style, layout=wide)

    def _add_engine_knobs(self, style: dict, wide: widgets.Layout, block_size: int,
                          max_num_batched_tokens: int, policy: str, enable_prefix_caching: bool,
                          batching: str) -> None:
        """The right column: the engine's own settings, the ones a lab turns to see what moves."""
        from labkit.sched.scheduler import POLICIES

        self.block_size = widgets.Dropdown(options=[8, 16, 32, 64, 128], value=block_size,
                                           description="block size", style=style, layout=wide)
        self.chunk = widgets.Dropdown(options=sorted({256, 512, 1024, 2048, 4096, 8192,
                                                      max_num_batched_tokens}),
                                      value=max_num_batched_tokens,
                                      description="token budget / step", style=style,
                                      layout=wide)
        self.policy = widgets.Dropdown(options=list(POLICIES), value=policy,
                                       description="policy", style=style, layout=wide)
        self.prefix = widgets.Checkbox(value=enable_prefix_caching,
                                       description="prefix caching")
        self.batching = widgets.ToggleButtons(options=["continuous", "static"], value=batching,
                                              description="batching", style=style)

    def settings(self) -> dict[str, Any]:
        """The simulate() keyword arguments the controls currently describe."""
        rate = self.arrival_rate.value
        return dict(model=self.model.value, gpu=self.gpu.value, workload=self.workload.value,
                    num_requests=self.num_requests.value, arrival_rate=rate or None,
                    block_size=self.block_size.value,
                    max_num_batched_tokens=self.chunk.value, policy=self.policy.value,
                    enable_prefix_caching=self.prefix.value, batching=self.batching.value,
                    seed=self.seed, **self.simulate_kw)

    def run(self) -> Any:
        """Simulate with the current settings and refresh every tab; returns the SimResult."""
        from labkit.sim.simulate import simulate

        kw = self.settings()
        self.status.value = "<i>simulating…</i>"
        self.progress.clear_output()
        try:
            with self.progress:
                result = simulate(progress=True, **kw)
        except ValueError as e:  # e.g. a model that does not fit the GPU: say so, keep going
            self.status.value = f"<span style='color:#c00'>cannot simulate: {e}</span>"
            return None
        self.progress.clear_output()
        self.result = result
        self.status.value = (f"{kw['model']} on {kw['gpu']}: {kw['num_requests']} "
                             f"{kw['workload']} requests, {len(result.trace.steps)} engine steps")
        self.metrics.value = _metrics_html(result.metrics, result.stats)
        self._update_tabs(result)
        return result

    def _update_tabs(self, result: Any) -> None:
        if self.schedule is None:
            self.schedule = ScheduleWidget(result.trace)
            self.memory = MemoryWidget(result.trace)
            self.latency = LatencyWidget(result)
            self.page_table = PageTableWidget(result.trace, max_blocks=512)
            self.tabs.children = [self.schedule, self.memory, self.latency, self.page_table]
            for i, name in enumerate(("schedule", "KV memory", "latency", "page table")):
                self.tabs.set_title(i, name)
            return
        self.schedule.set_trace(result.trace)
        self.memory.set_trace(result.trace)
        self.latency.set_source(result)
        self.page_table.set_trace(result.trace)

    def _changed(self, _change: dict) -> None:
        if self.auto.value:
            self.run()


class SpecControls(widgets.VBox):
    """γ (draft length) and drafting method for the real tiny engine; re-runs and redraws.

    `prompts`: strings to generate from. `llm_kw` go to `labkit.LLM` (e.g. num_blocks).
    """

    def __init__(self, prompts: list[str], model: str = "labkit-tiny",
                 draft: str = "labkit-tiny-draft-distilled", gamma: int = 4,
                 method: str = "draft_model",
                 max_tokens: int = 32, run: bool = True, **llm_kw: Any) -> None:
        if not prompts:
            raise ValueError("SpecControls needs at least one prompt")
        self.prompts, self.model_name, self.draft, self.max_tokens = prompts, model, draft, \
            max_tokens
        self.llm_kw = llm_kw
        # the label takes the width it needs ('initial'), not ipywidgets' fixed default that
        # squeezed "γ (draft len)" over the slider; the slider keeps room to drag
        label = {"description_width": "initial"}
        self.gamma = widgets.IntSlider(value=gamma, min=1, max=8, description="γ (draft len)",
                                       style=label, layout=widgets.Layout(width="340px"))
        self.method = widgets.ToggleButtons(options=["draft_model", "ngram"], value=method,
                                            description="method", style=label)
        self.run_button = widgets.Button(description="Run", button_style="primary")
        self.status = widgets.HTML()
        self.run_button.on_click(lambda _: self.run())
        self.gamma.observe(lambda _: self.run(), names="value")
        self.method.observe(lambda _: self.run(), names="value")
        self.widget: SpecWidget | None = None
        self.holder = widgets.VBox()
        self._target = None
        super().__init__([widgets.HBox([self.gamma, self.method, self.run_button]),
                          self.status, self.holder])
        if run:
            self.run()

    def run(self) -> Any:
        """Generate greedily with speculation; returns the engine (its trace has the spec log)."""
        import labkit

        if self._target is None:
            self._target = labkit.load_pretrained(self.model_name)
        cfg: dict[str, Any] = {"method": self.method.value,
                               "num_speculative_tokens": self.gamma.value}
        if self.method.value == "draft_model":
            cfg["model"] = self.draft
        model, tokenizer = self._target
        llm = labkit.LLM.from_model(model, tokenizer, speculative_config=cfg, **self.llm_kw)
        params = labkit.SamplingParams(temperature=0.0, max_tokens=self.max_tokens)
        llm.generate(self.prompts, params)
        engine = llm.llm_engine
        if self.widget is None:
            self.widget = SpecWidget(engine, tokenizer=tokenizer)
            self.holder.children = [self.widget]
        else:
            self.widget.set_trace(engine)
        self.status.value = f"{self.method.value}, γ = {self.gamma.value}: " \
            f"{len(engine.trace.steps)} engine steps"
        self.engine = engine
        return engine
