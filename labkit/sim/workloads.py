"""Request workloads: how long prompts and outputs are, and when requests arrive.

Why the distribution matters more than the mean: continuous batching, paging and preemption all
exist because request lengths vary. With fixed lengths, static batching wastes nothing and
max-length pre-allocation wastes only the gap to the maximum; with long-tailed lengths, a static
batch idles until its longest member finishes and a pre-allocated slot is mostly empty.

Named workloads (``get_workload(name, **kw)``):

- ``fixed``: every request has ``prompt_len`` / ``output_len`` tokens.
- ``uniform``: lengths uniform on ``[prompt_min, prompt_max]`` and ``[output_min, output_max]``.
- ``chat``: ShareGPT-like, long-tailed. The vLLM paper (Kwon et al., SOSP 2023, §6.1, Fig. 11)
  reports ShareGPT means of 161 input and 338 output tokens. We model each as a lognormal, clipped
  to ``[1, max]`` and rounded, whose ``mu`` is solved so the clipped mean equals the paper's mean
  (moment matching; ``fit_lognormal_mu``). The spread ``sigma`` is our choice — the raw traces are
  not shipped — picked so the tail reaches several times the mean as in Fig. 11. Parameters and
  sources live in ``datasets/workloads/chat_lengths.json``.
- ``alpaca``: short instruction-following requests, means 19 input / 58 output (same paper),
  ``datasets/workloads/alpaca_lengths.json``.
- ``lognormal``: your own means and spreads (``output_sigma`` 0 = fixed lengths).
- ``shared-prefix``: ``num_groups`` system prompts of ``prefix_len`` tokens, each request one of
  them plus a uniform suffix — the case prefix caching is for.

Arrivals: all at t = 0 (offline batch) or a Poisson process at ``arrival_rate`` requests/s
(exponential gaps), as vLLM's serving benchmark does. Every draw uses a seeded numpy Generator.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from labkit.paths import DATASETS_DIR

WORKLOADS_DIR = DATASETS_DIR / "workloads"


@dataclass(frozen=True)
class RequestSpec:
    """One request as a workload draws it. ``prefix_len`` leading tokens are shared by every
    request of ``prefix_group``; ``seed`` makes the rest of its synthetic prompt unique."""

    prompt_len: int
    output_len: int
    arrival_time: float
    priority: int = 0
    prefix_group: int | None = None
    prefix_len: int = 0
    seed: int = 0

    def prompt_token_ids(self, vocab_size: int = 32000, first_id: int = 3) -> list[int]:
        """Deterministic synthetic token ids (ids below ``first_id`` are left to special tokens):
        the group's shared prefix, then tokens unique to this request. Lets the token-less
        simulator exercise prefix caching with real block hashes."""
        if vocab_size <= first_id:
            raise ValueError(f"vocab_size must exceed first_id={first_id}, got {vocab_size}")
        span = vocab_size - first_id
        prefix: list[int] = []
        if self.prefix_group is not None and self.prefix_len:
            prefix = list(_group_prefix(self.prefix_group, self.prefix_len, span, first_id))
        rng = np.random.default_rng([2, self.seed])
        rest = rng.integers(0, span, self.prompt_len - len(prefix))
        return prefix + (rest + first_id).tolist()


@functools.lru_cache(maxsize=1024)
def _group_prefix(group: int, length: int, span: int, first_id: int) -> tuple[int, ...]:
    """A group's shared prefix, drawn once: thousands of requests repeat it (fleet traces)."""
    g = np.random.default_rng([1, group])
    return tuple((g.integers(0, span, length) + first_id).tolist())


def _norm_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def clipped_lognormal_mean(mu: float, sigma: float, lo: float, hi: float) -> float:
    """E[clip(X, lo, hi)] for X ~ LogNormal(mu, sigma), in closed form."""
    a, b = math.log(lo), math.log(hi)
    p_lo, p_hi = _norm_cdf((a - mu) / sigma), 1.0 - _norm_cdf((b - mu) / sigma)
    body = math.exp(mu + sigma**2 / 2) * (
        _norm_cdf((b - mu - sigma**2) / sigma) - _norm_cdf((a - mu - sigma**2) / sigma))
    return lo * p_lo + body + hi * p_hi


def fit_lognormal_mu(mean: float, sigma: float, lo: float, hi: float) -> float:
    """The ``mu`` whose lognormal, clipped to [lo, hi], has the given mean (bisection; the
    clipped mean increases monotonically with mu)."""
    if not lo < mean < hi:
        raise ValueError(f"mean {mean} must lie strictly inside [{lo}, {hi}]")
    left, right = math.log(lo) - 10 * sigma, math.log(hi) + 10 * sigma
    for _ in range(200):
        mid = (left + right) / 2
        if clipped_lognormal_mean(mid, sigma, lo, hi) < mean:
            left = mid
        else:
            right = mid
    return (left + right) / 2


class Workload:
    """Base class: subclasses draw lengths; arrivals and RequestSpec assembly live here."""

    name = "workload"

    def _lengths(self, rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
        raise NotImplementedError

    def _extras(self, rng: np.random.Generator, n: int) -> list[dict[str, Any]]:
        return [{} for _ in range(n)]

    def sample(self, num_requests: int, seed: int = 0,
               arrival_rate: float | None = None) -> list[RequestSpec]:
        """Draw ``num_requests`` requests; arrivals at t=0, or Poisson at ``arrival_rate``/s."""
        if num_requests < 0:
            raise ValueError(f"num_requests must be >= 0, got {num_requests}")
        if arrival_rate is not None and not arrival_rate > 0:
            raise ValueError(f"arrival_rate must be > 0 requests/s (or None), got {arrival_rate}")
        rng = np.random.default_rng(seed)
        prompts, outputs = self._lengths(rng, num_requests)
        extras = self._extras(rng, num_requests)
        if arrival_rate is None:
            arrivals = np.zeros(num_requests)
        else:
            arrivals = np.cumsum(rng.exponential(1.0 / arrival_rate, num_requests))
        return [
            RequestSpec(int(p), int(o), float(t), seed=seed * 1_000_003 + i, **x)
            for i, (p, o, t, x) in enumerate(zip(prompts, outputs, arrivals, extras))
        ]

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, **{k: v for k, v in vars(self).items() if not k.startswith("_")}}


def _check_range(label: str, lo: int, hi: int) -> None:
    if not 1 <= lo <= hi:
        raise ValueError(f"{label}: need 1 <= min <= max, got [{lo}, {hi}]")


class FixedWorkload(Workload):
    name = "fixed"

    def __init__(self, prompt_len: int = 128, output_len: int = 128):
        _check_range("prompt_len", prompt_len, prompt_len)
        _check_range("output_len", output_len, output_len)
        self.prompt_len, self.output_len = prompt_len, output_len

    def _lengths(self, rng, n):
        return np.full(n, self.prompt_len), np.full(n, self.output_len)


class UniformWorkload(Workload):
    name = "uniform"

    def __init__(self, prompt_min: int = 32, prompt_max: int = 512, output_min: int = 16,
                 output_max: int = 512):
        _check_range("prompt", prompt_min, prompt_max)
        _check_range("output", output_min, output_max)
        self.prompt_min, self.prompt_max = prompt_min, prompt_max
        self.output_min, self.output_max = output_min, output_max

    def _lengths(self, rng, n):
        return (rng.integers(self.prompt_min, self.prompt_max + 1, n),
                rng.integers(self.output_min, self.output_max + 1, n))


@dataclass(frozen=True)
class LengthDist:
    """A clipped, rounded lognormal length distribution (see the module docstring)."""

    mean: float
    sigma: float
    mu: float
    min: int
    max: int

    @classmethod
    def fit(cls, mean: float, sigma: float, lo: int, hi: int) -> LengthDist:
        """The distribution with this spread whose clipped mean is ``mean``; sigma 0 = fixed."""
        if sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {sigma}")
        if not lo <= mean <= hi:
            raise ValueError(f"mean length {mean} must lie in [{lo}, {hi}]")
        mu = math.log(mean) if sigma == 0 else fit_lognormal_mu(mean, sigma, lo, hi)
        return cls(mean, sigma, mu, lo, hi)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = rng.lognormal(self.mu, self.sigma, n)
        return np.clip(np.rint(x), self.min, self.max).astype(np.int64)


def load_length_file(name: str) -> dict[str, Any]:
    """Read ``datasets/workloads/<name>_lengths.json`` (parameters plus their source)."""
    path = WORKLOADS_DIR / f"{name}_lengths.json"
    if not path.exists():
        raise ValueError(f"no length distribution file {path}")
    return json.loads(path.read_text())


class LognormalWorkload(Workload):
    """Chat-like (``chat``) or instruction-like (``alpaca``) lengths from a datasets file.
    ``max_prompt_len`` / ``max_output_len`` clip further, e.g. to fit a small model's context
    (which lowers the means; the result records them)."""

    def __init__(self, name: str, max_prompt_len: int | None = None,
                 max_output_len: int | None = None):
        spec = load_length_file(name)
        self.name, self.source = name, spec["source"]
        self._prompt = LengthDist(**{k: spec["prompt"][k] for k in ("mean", "sigma", "mu",
                                                                      "min", "max")})
        self._output = LengthDist(**{k: spec["output"][k] for k in ("mean", "sigma", "mu",
                                                                      "min", "max")})
        for label, cap in (("max_prompt_len", max_prompt_len), ("max_output_len", max_output_len)):
            if cap is not None and cap < 1:
                raise ValueError(f"{label} must be >= 1, got {cap}")
        self.max_prompt_len, self.max_output_len = max_prompt_len, max_output_len

    def _lengths(self, rng, n):
        p, o = self._prompt.sample(rng, n), self._output.sample(rng, n)
        if self.max_prompt_len:
            p = np.minimum(p, self.max_prompt_len)
        if self.max_output_len:
            o = np.minimum(o, self.max_output_len)
        return p, o


class ParametricLognormalWorkload(Workload):
    """``lognormal``: choose the means and spreads yourself (sigma 0 = every request the same
    length). The batching benchmark sweeps ``output_sigma`` to show how output-length variance
    decides what continuous batching gains over static batching."""

    name = "lognormal"

    def __init__(self, prompt_mean: float = 128, prompt_sigma: float = 0.0,
                 output_mean: float = 128, output_sigma: float = 1.0,
                 max_prompt_len: int = 1024, max_output_len: int = 1024):
        self.prompt_mean, self.prompt_sigma = prompt_mean, prompt_sigma
        self.output_mean, self.output_sigma = output_mean, output_sigma
        self.max_prompt_len, self.max_output_len = max_prompt_len, max_output_len
        self._prompt = LengthDist.fit(prompt_mean, prompt_sigma, 1, max_prompt_len)
        self._output = LengthDist.fit(output_mean, output_sigma, 1, max_output_len)

    def _lengths(self, rng, n):
        return self._prompt.sample(rng, n), self._output.sample(rng, n)


class SharedPrefixWorkload(Workload):
    """Requests share one of ``num_groups`` system prompts of ``prefix_len`` tokens, then add a
    uniform ``[suffix_min, suffix_max]`` suffix; outputs uniform ``[output_min, output_max]``."""

    name = "shared-prefix"

    def __init__(self, num_groups: int = 1, prefix_len: int = 512, suffix_min: int = 16,
                 suffix_max: int = 128, output_min: int = 16, output_max: int = 256):
        if num_groups < 1 or prefix_len < 1:
            raise ValueError(f"need num_groups >= 1 and prefix_len >= 1, got {num_groups}, "
                             f"{prefix_len}")
        _check_range("suffix", suffix_min, suffix_max)
        _check_range("output", output_min, output_max)
        self.num_groups, self.prefix_len = num_groups, prefix_len
        self.suffix_min, self.suffix_max = suffix_min, suffix_max
        self.output_min, self.output_max = output_min, output_max

    def _lengths(self, rng, n):
        suffix = rng.integers(self.suffix_min, self.suffix_max + 1, n)
        return self.prefix_len + suffix, rng.integers(self.output_min, self.output_max + 1, n)

    def _extras(self, rng, n):
        groups = rng.integers(0, self.num_groups, n)
        return [{"prefix_group": int(g), "prefix_len": self.prefix_len} for g in groups]


WORKLOADS = ("fixed", "uniform", "chat", "alpaca", "lognormal", "shared-prefix")


def get_workload(name: str | Workload, **kw: Any) -> Workload:
    """Build a named workload; keyword arguments go to its constructor."""
    if isinstance(name, Workload):
        return name
    key = name.strip().lower().replace("_", "-")
    if key == "fixed":
        return FixedWorkload(**kw)
    if key == "uniform":
        return UniformWorkload(**kw)
    if key in ("chat", "sharegpt", "alpaca"):
        return LognormalWorkload("alpaca" if key == "alpaca" else "chat", **kw)
    if key == "lognormal":
        return ParametricLognormalWorkload(**kw)
    if key in ("shared-prefix", "prefix"):
        return SharedPrefixWorkload(**kw)
    raise ValueError(f"unknown workload {name!r}; valid names: {', '.join(WORKLOADS)}")


def load_prompt_set(name: str) -> list[dict[str, Any]]:
    """Read a prompt set written for the lab, ``datasets/workloads/<name>.jsonl`` (one JSON
    object per line), e.g. ``code_prompts`` or ``chat_prompts``."""
    path = WORKLOADS_DIR / f"{name}.jsonl"
    if not path.exists():
        sets = sorted(p.stem for p in WORKLOADS_DIR.glob("*.jsonl"))
        raise ValueError(f"unknown prompt set {name!r}; available: {', '.join(sets)}")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def prompt_texts(name: str) -> list[str]:
    """The prompt strings of a prompt set: ``prompt``, or ``system`` + ``user`` for chat sets
    (every chat prompt begins with the same system prompt, so prefix caching can share it)."""
    return [r["prompt"] if "prompt" in r else r["system"] + r["user"]
            for r in load_prompt_set(name)]
