"""Exercise 13 (prefix_affinity): the reference and labkit's own router policy pass; plausible
wrong policies are rejected with the message that names the mistake (negative controls)."""

import pytest

from labkit.exercises import prefix_affinity as P
from labkit.exercises import prefix_affinity_solutions as S
from labkit.router.policies import PrefixAffinity as RouterPrefixAffinity


class ModuloHashing(S.PrefixAffinity):
    """hash(prefix) % n over the replicas sorted by name: even and order-free, not consistent."""

    def choose(self, key, replicas):
        h = self.prefix_hash(key.token_ids)
        if not replicas or h is None:
            return super().choose(key, replicas)
        return sorted(replicas, key=lambda r: r.name)[h % len(replicas)]


class NoLoadBound(S.PrefixAffinity):
    """The ring without the cap: the hot prefix's replica takes everything."""

    def __init__(self, block_size=16, num_blocks=8, eps=0.25):
        super().__init__(block_size, num_blocks, 1e9)


class WholePrompt(S.PrefixAffinity):
    """Hashes every token: each user's own text gives every request its own key."""

    def prefix_hash(self, token_ids):
        return S.h64(repr(list(token_ids)).encode())


class FixedWindow(S.PrefixAffinity):
    """Hashes the leading block_size * num_blocks tokens, not cut to whole blocks."""

    def prefix_hash(self, token_ids):
        ids = list(token_ids)[: self.block_size * self.num_blocks]
        return S.h64(repr(ids).encode()) if len(ids) >= self.block_size else None


class OnePointPerReplica(S.PrefixAffinity):
    def __init__(self, block_size=16, num_blocks=8, eps=0.25):
        super().__init__(block_size, num_blocks, eps, vnodes=1)


class RingByPosition(S.PrefixAffinity):
    """Ring points from the replica's index in the list instead of its name."""

    def choose(self, key, replicas):
        renamed = {f"slot-{i}": r for i, r in enumerate(replicas)}

        class Slot:
            def __init__(self, name, r):
                self.name, self.outstanding = name, r.outstanding

        slots = [Slot(n, r) for n, r in renamed.items()]
        return renamed[super().choose(key, slots).name] if replicas else \
            super().choose(key, replicas)


class CountsItself(S.PrefixAffinity):
    """Increments the chosen replica's count: the router already does, so it counts twice."""

    def choose(self, key, replicas):
        r = super().choose(key, replicas)
        r.outstanding += 1
        return r


class NoEmptyCheck(S.PrefixAffinity):
    def choose(self, key, replicas):
        return super().choose(key, replicas) if replicas else None


WRONG = [
    (ModuloHashing, ["removing replica-3 moved", "hash % n", "expected: 0"]),
    (NoLoadBound, ["already held", "and was sent another", "the hot prefix used 1 replica(s)",
                   "bounded load", "ceil((1 + 0.25) *"]),
    (WholePrompt, ["sharing a 64-token system prompt", "went to", "each user's own text"]),
    (FixedWindow, ["partial third block", "never on a partial block"]),
    (OnePointPerReplica, ["far from even", "vnodes points"]),
    (RingByPosition, ["another order", "by replica NAME"]),
    (NoEmptyCheck, ["raise NoReplicaError"]),
    (CountsItself, ["changed the replicas' outstanding counts", "the router counts"]),
]


@pytest.mark.parametrize("cls,needles", WRONG, ids=[w[0].__name__ for w in WRONG])
def test_wrong_policy_caught(cls, needles):
    result = P.check_prefix_affinity(cls)
    assert not result.passed and result.message.startswith("✗ prefix_affinity"), result.message
    for needle in needles:
        assert needle in result.message, f"{needle!r} not in:\n{result.message}"


def test_reference_passes_with_measured_numbers():
    result = P.check_prefix_affinity(S.PrefixAffinity)
    assert result.passed, result.message
    assert "moved none of the others' prefixes" in result.message
    assert "never over the cap" in result.message and "round-robin's" in result.message


def test_labkit_router_policy_passes_the_same_checker():
    """An independent implementation (engine block hashes, its own ring) passes too: the
    checker measures properties, not one ring's choices."""
    result = P.check_prefix_affinity(
        lambda block_size, num_blocks, eps: RouterPrefixAffinity(block_size, num_blocks, eps))
    assert result.passed, result.message


def test_solution_spills_a_hot_prefix_but_keeps_it_on_few_replicas():
    """Hand-made case: 4 replicas, a prefix whose home is full walks to the next under the cap."""
    pol = S.PrefixAffinity(block_size=4, num_blocks=1, eps=0.5)
    reps = P.replicas(4)
    key = P.RouteKey(token_ids=[1, 2, 3, 4])
    home = pol.choose(key, reps)
    home.outstanding = 3  # m = 4, cap = ceil(1.5 * 4 / 4) = 2: home is full
    second = pol.choose(key, reps)
    assert second is not home
    second.outstanding = 1  # m = 5, cap = ceil(1.5 * 5 / 4) = 2: second still has room
    assert pol.choose(key, reps) is second
