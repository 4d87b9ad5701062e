"""The harness of ``labkit bench kernels``: timing, checks and rows, one guarded section at a time.

Why a class: every section adds correctness checks and timed rows to one payload, and a section
that raises (a kernel that does not compile on this GPU) must cost its own rows only, not the
run; :meth:`Bench.guarded` records the error and the run goes on.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from labkit.bench.common import environment, timed
from labkit.bench.kernels_report import targets
from labkit.kv.ops import gather_blocks


def _wall_ms(fn: Callable[..., Any], args: tuple = ()) -> float:
    """CPU stand-in for the GPU timers (the smoke run under the interpreter)."""
    fn(*args)
    return timed(fn, *args)[1].wall_s * 1e3


def _gathered(cache: torch.Tensor, block_tables: torch.Tensor, ctx: int) -> torch.Tensor:
    """[B, Hkv, ctx, D] contiguous copy, the layout SDPA wants."""
    return gather_blocks(cache, block_tables)[:, :ctx].transpose(1, 2).contiguous()


def _sdpa(q, k, v, **kw):
    try:
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw)
    except TypeError:  # torch without enable_gqa
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                              v.repeat_interleave(rep, 1), **kw)


class Bench:
    """Collects checks and results; each section runs guarded so one failure costs one row."""

    def __init__(self, sizes: dict, device: str, seed: int = 0):
        self.sizes, self.device = sizes, device
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.copy_gbps: float | None = None
        self.checks: list[dict] = []
        self.results: list[dict] = []
        self.errors: list[dict] = []

    def measure(self, fn: Callable[..., Any], *args: Any, eager: bool = True) -> dict[str, Any]:
        """Device ms per call of fn(*args): a CUDA graph over rotated input copies (see
        labkit.kernels.timing), with the eager do_bench time beside it."""
        if not torch.cuda.is_available():
            return {"ms": _wall_ms(fn, args), "timing": "cpu wall clock"}
        from labkit.kernels import timing

        out: dict[str, Any] = {}
        if eager:
            out["eager_ms"] = timing.eager_time_ms(lambda: fn(*args))
        try:
            out["ms"], out["timing"] = timing.graph_time_ms(fn, args), "cuda-graph"
        except Exception as e:  # noqa: BLE001 - e.g. a baseline that syncs: keep eager time
            torch.cuda.synchronize()
            out["ms"] = out.get("eager_ms") or timing.eager_time_ms(lambda: fn(*args))
            out["timing"] = f"eager (graph capture failed: {repr(e)[:120]})"
        return out

    def guarded(self, name: str, fn: Callable[[], None]) -> None:
        t = time.perf_counter()
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - report and carry on with the other sections
            self.errors.append({"section": name, "error": repr(e),
                                "traceback": traceback.format_exc(limit=6)})
            print(f"[{name}] FAILED: {e!r}", flush=True)
        print(f"[{name}] {time.perf_counter() - t:.1f}s", flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def check(self, kernel: str, shape: str, err: float, tol: float) -> None:
        ok = err <= tol
        self.checks.append({"kernel": kernel, "shape": shape, "rel_err": err, "tol": tol,
                            "ok": ok})
        print(f"  check {kernel:28s} {shape:34s} rel_err {err:.2e} (tol {tol:.0e}) "
              f"{'ok' if ok else 'FAIL'}", flush=True)

    def add(self, kernel: str, shape: str, t: dict[str, Any], baseline: str | None = None,
            base: dict[str, Any] | None = None, nbytes: float | None = None,
            flops: float | None = None, **extra: Any) -> None:
        ms = t["ms"]
        row: dict[str, Any] = {"kernel": kernel, "shape": shape, "ms": ms}
        if nbytes is not None:
            row["achieved_gbps"] = nbytes / ms / 1e6
            if self.copy_gbps:
                row["ratio_to_copy_bandwidth"] = row["achieved_gbps"] / self.copy_gbps
        if flops is not None:
            row["tflops"] = flops / ms / 1e9
        if base is not None:
            row.update(baseline=baseline, baseline_ms=base["ms"],
                       speedup_vs_baseline=base["ms"] / ms,
                       baseline_eager_ms=base.get("eager_ms"))
        row.update(eager_ms=t.get("eager_ms"), timing=t.get("timing"), **extra)
        self.results.append(row)
        print("  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in row.items() if v is not None), flush=True)

    def payload(self) -> dict[str, Any]:
        dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        return {"device": dev, "copy_gbps": self.copy_gbps, "checks": self.checks,
                "results": self.results, "errors": self.errors, "targets": targets(self),
                "environment": environment()}
