"""``labkit bench ops isolation``: the two layouts' server commands and the CPU accounting (the
live run itself starts four servers: it is run by hand, ``labkit bench ops isolation --quick``)."""

from __future__ import annotations

import os
import time

from labkit.bench.ops import describe
from labkit.bench.ops_isolation import QUICK, _cpu_seconds, _servers


def test_partitioned_pins_disjoint_cores_and_shared_does_not():
    part = _servers("partitioned", QUICK)
    assert [s.cmd[:3] for s in part] == [["taskset", "-c", "0"], ["taskset", "-c", "1"]]
    assert all(s.env["OMP_NUM_THREADS"] == "1" for s in part)
    shared = _servers("shared", QUICK)
    assert all(s.cmd[0] != "taskset" for s in shared)
    assert all(s.env["OMP_NUM_THREADS"] == str(os.cpu_count()) for s in shared)
    assert all(s.env["OMP_WAIT_POLICY"] == "PASSIVE" for s in part + shared)
    for s in part + shared:  # same engine settings in both layouts: a fixed KV pool each
        assert s.cmd[s.cmd.index("--num-blocks") + 1] == str(QUICK["num_blocks"])


def test_cpu_seconds_counts_this_process_work():
    before = _cpu_seconds(os.getpid())
    t = time.process_time()
    while time.process_time() - t < 0.3:
        sum(range(1000))
    assert _cpu_seconds(os.getpid()) - before >= 0.2


def test_listed():
    assert any(line.startswith("isolation:") for line in describe())


def test_noisy_neighbour_runs_fcfs_fair_and_a_quota_of_half_the_batch():
    from labkit.bench.ops_noisy import POLICIES, QUICK
    from labkit.bench.serve_fairness import policy_args

    assert POLICIES == ("fcfs", "fair", "quota")
    assert policy_args("quota", QUICK) == ["--policy", "fcfs", "--tenant-max-running",
                                           str(QUICK["fair_max_num_seqs"] // 2)]
    assert policy_args("fair", QUICK) == ["--policy", "fair"]
    assert any(line.startswith("noisy-neighbour:") for line in describe())
