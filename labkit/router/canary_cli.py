"""``labkit router`` flags for a canary, and the :class:`~labkit.router.canary.Canary` they
describe (its own module: it joins the canary with the PromQL source of
``labkit.router.prometheus``, which itself reads the canary's arm names)."""

from __future__ import annotations

import argparse

from labkit.router.canary import Canary, CanaryAnalysis, CanarySplit
from labkit.router.prometheus import PromQLCanarySource


def add_canary_args(p: argparse.ArgumentParser) -> None:
    """``labkit router`` flags for a canary."""
    g = p.add_argument_group("canary")
    g.add_argument("--canary", action="append", metavar="URL", help="a candidate replica "
                   "(repeat); it gets --canary-weight of the traffic and is watched")
    g.add_argument("--canary-weight", type=float, default=0.1, metavar="W")
    g.add_argument("--canary-min-samples", type=int, default=100, metavar="N",
                   help="requests per arm before any verdict")
    g.add_argument("--canary-interval", type=int, default=25, metavar="N",
                   help="candidate requests between checks (router counters)")
    g.add_argument("--canary-threshold", type=int, default=2, metavar="K",
                   help="consecutive failed checks that roll back")
    g.add_argument("--canary-max-error-increase", type=float, default=0.05, metavar="D")
    g.add_argument("--canary-max-ttft-ratio", type=float, default=1.5, metavar="R")
    g.add_argument("--canary-prometheus", default=None, metavar="URL", help="read the verdict "
                   "from this Prometheus (PromQL), as Flagger does; the router's counters are "
                   "the fallback when it does not answer")
    g.add_argument("--canary-prometheus-interval", type=float, default=5.0, metavar="S")
    g.add_argument("--canary-prometheus-window", default="1m", metavar="RANGE",
                   help="PromQL range the rates are taken over, e.g. 30s, 1m")


def canary_from_args(args: argparse.Namespace) -> Canary | None:
    """A :class:`Canary` from the parsed flags (None without ``--canary``)."""
    if not args.canary:
        for flag in ("canary_prometheus",):
            if getattr(args, flag):
                raise ValueError(f"--{flag.replace('_', '-')} needs --canary URL")
        return None
    analysis = CanaryAnalysis(window=max(400, args.canary_min_samples),
                              min_samples=args.canary_min_samples,
                              interval=args.canary_interval, threshold=args.canary_threshold,
                              max_error_increase=args.canary_max_error_increase,
                              max_ttft_p99_ratio=args.canary_max_ttft_ratio)
    promql = None
    if args.canary_prometheus:
        promql = PromQLCanarySource(args.canary_prometheus, args.canary_prometheus_window)
    return Canary(CanarySplit(args.canary_weight), analysis, promql,
                  args.canary_prometheus_interval)
