"""Exercise: the scheduler side of a KV connector, run inside the real engine.

A KV connector (``labkit.kv.connector``; vLLM v1's ``KVConnectorBase_V1``) lets KV that this
engine did not just compute stand in for a prefill: from a CPU or disk tier, or pushed by a
prefill instance. Its scheduler side answers two questions at admission, and both answers are
easy to get subtly wrong:

* ``block_keys(token_ids, block_size, salt, hash_block)``: the key of every *full* block of a
  prompt, chained (``key_i = hash_block(key_{i-1}, tokens of block i, salt)``) so a block's key
  stands for the whole prefix, and salted so two tenants never share KV;
* ``num_matched_tokens(keys, in_store, num_prompt_tokens, num_computed_tokens, block_size)``:
  after the device prefix cache matched ``num_computed_tokens``, how many MORE tokens the store
  holds: consecutive whole blocks from block ``num_computed_tokens // block_size`` up to the
  first miss, and never the prompt's last token (the model needs its logits to sample);
* ``blocks_to_load(block_table, num_computed_tokens, num_external_tokens, block_size)``: which
  of the request's device blocks receive those tokens' KV.

The checker plugs the three into an offloading connector (device -> CPU tier) and runs an
engine with a device pool too small to keep prefixes on six real code prompts from two tenants,
beside an engine with labkit's own connector. Every request's matched count and load targets
must equal labkit's, and every greedy output the reference ``generate``. It names the classic
mistakes: a count that covers the last token or a partial block, keys without the salt (tenant B
would read tenant A's KV), loads into blocks the engine did not allocate for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.inject import inject as _inject
from labkit.kv.connector import OffloadingConnector
from labkit.kv.prefix import hash_block_tokens

MODEL, BS, NUM_BLOCKS, MAX_NEW = "labkit-tiny", 4, 14, 4
DOCS = ['def read_config(path):\n    """Parse an INI file into a dict."""\n    with open(',
        "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(",
        "import os\nimport sys\n\n\ndef main(argv):\n    for name in os.listdir(argv[1]):\n"]
QUESTIONS = ["path) as f:", "self, x):", "        print(", "path, 'r')"]


def inject(name: str, learner: Callable) -> Callable:
    """The reference under ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's own."""
    return _inject(name, learner, "kv_connector_solutions")


def requests(tok: Any) -> list[tuple[list[int], str]]:
    """(prompt ids, tenant) in arrival order: three documents, then the first again (its
    blocks now only in the CPU tier), the first for ANOTHER tenant (must match nothing), the
    second cut at a whole number of blocks (the last block must not be matched whole), then a
    new block followed by the third document's later blocks (on the device: the new block; in
    the store: those blocks, but under another prefix, so nothing may match)."""
    d = [tok.encode(x) for x in DOCS]
    q = [tok.encode(x) for x in QUESTIONS]
    exact = d[1][: len(d[1]) // BS * BS]
    head = tok.encode("# utils\n")[:BS]  # one block of its own, put on the device
    assert len(head) == BS and head != d[2][:BS]
    return [(d[0] + q[0], "A"), (d[1] + q[1], "A"), (d[2] + q[2], "A"),
            (d[0] + q[3], "A"), (d[0] + q[3], "B"), (exact, "A"),
            (head + q[1], "A"), (head + d[2][BS:] + q[0], "A")]


class _Recording(OffloadingConnector):
    """labkit's connector, recording each admission's answer (the reference)."""

    def __init__(self) -> None:
        super().__init__(cpu_bytes=64 << 20)
        self.matched: list[int] = []
        self.loads: list[list[int]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        n = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self.matched.append(n)
        return n

    def update_state_after_alloc(self, request: Any, blocks: list[int], num_ext: int) -> None:
        self.loads.append(list(blocks))
        super().update_state_after_alloc(request, blocks, num_ext)


class LearnerConnector(_Recording):
    """The same connector with the learner's three functions on its scheduler side."""

    def __init__(self, block_keys: Callable, num_matched_tokens: Callable,
                 blocks_to_load: Callable) -> None:
        super().__init__()
        self.fns = (block_keys, num_matched_tokens, blocks_to_load)
        self.request_index = 0

    def block_hashes(self, seq: Any, n: int) -> list:
        """Saves and lookups both use the learner's keys (forgetting the salt would let
        another tenant's request read these blocks: the check below sees it)."""
        keys = call(self.fns[0], list(seq.token_ids), self.block_size, seq.cache_salt,
                    hash_block_tokens)
        return list(keys)[:n]

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        store, bs = self._need_store(), self.block_size
        self._matched.pop(request.seq_id, None)
        keys = self.block_hashes(request, len(request.token_ids) // bs)
        total = len(request.token_ids)
        n = call(self.fns[1], keys, lambda k: k in store, total, num_computed_tokens, bs)
        if not isinstance(n, int) or n % bs or not 0 <= n <= total - 1 - num_computed_tokens:
            raise CheckFailure(
                "num_matched_tokens answered a count the engine cannot use",
                inputs=f"request {self.request_index}: {total} prompt tokens, "
                f"{num_computed_tokens} already on the device, block_size {bs}",
                expected=f"a multiple of {bs} in [0, {total - 1 - num_computed_tokens}]",
                actual=n, hint="whole blocks only, and never the prompt's last token: the "
                "model must compute it to have logits to sample from (a prompt of exactly k "
                "full blocks can take at most k - 1 from the store).")
        first = num_computed_tokens // bs
        found = [store.get(k) for k in keys[first:first + n // bs]]
        if any(f is None for f in found):
            raise CheckFailure("num_matched_tokens counted a block the store does not hold",
                               inputs=f"request {self.request_index}", actual=n,
                               hint="stop at the first key that is not in the store.")
        self._matched[request.seq_id] = (num_computed_tokens, found)
        self.matched.append(n)
        return n

    def update_state_after_alloc(self, request: Any, blocks: list[int], num_ext: int) -> None:
        got = call(self.fns[2], list(request.block_table), request.num_computed_tokens, num_ext,
                   self.block_size)
        if list(got) != list(blocks):
            raise CheckFailure(
                "blocks_to_load picked other device blocks than the engine allocated for the "
                "matched tokens", inputs=f"request {self.request_index}: block_table "
                f"{list(request.block_table)}, {request.num_computed_tokens} tokens on the device,"
                f" {num_ext} to load", expected=list(blocks), actual=got,
                hint="the loaded tokens come right after the device-cached ones: block_table"
                "[num_computed_tokens // block_size :] for num_external_tokens // block_size "
                "blocks. Any other block holds another prefix's KV (or nothing yet).")
        self.request_index += 1
        super().update_state_after_alloc(request, blocks, num_ext)


def _run(connector: _Recording, model: Any, reqs: list[tuple[list[int], str]]) -> list[list[int]]:
    from labkit.engine.llm import LLM
    from labkit.engine.sampling_params import SamplingParams

    llm = LLM.from_model(model, block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=1,
                         kv_connector=connector)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    try:
        return [llm.generate(prompt_token_ids=[p], sampling_params=sp, cache_salt=salt)[0]
                .outputs[0].token_ids for p, salt in reqs]
    finally:
        connector.close()


def _compare(got: list[int], want: list[int], reqs: list[tuple[list[int], str]]) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        if g == w:
            continue
        salt = reqs[i][1]
        other = any(s != salt and p[:BS] == reqs[i][0][:BS] for p, s in reqs[:i])
        hint = ("this tenant's prompt shares its prefix with another tenant's stored blocks: "
                "the salt must go into every key (hash_block(prev, tokens, salt)), or tenant "
                f"{salt} reads KV it never computed." if other and g > w else
                "start at block num_computed_tokens // block_size, count consecutive keys in "
                "the store, stop at the first miss; the keys are chained (each one is hashed "
                "from the previous key), so an unchained key matches other prompts' blocks.")
        raise CheckFailure("wrong number of matched tokens", inputs=f"request {i} (tenant "
                           f"{salt}, {len(reqs[i][0])} prompt tokens)", expected=w, actual=g,
                           hint=hint)


def _hand_cases(num_matched_tokens: Callable, blocks_to_load: Callable) -> None:
    """Small cases with the answer worked out by hand, before the engine run: a miss in the
    middle of the store, a device hit to start after, a prompt of whole blocks."""
    keys = ["k0", "k1", "k2", "k3"]
    cases = [  # (store, prompt tokens, on device, expected, why)
        ({"k0", "k2", "k3"}, 17, 0, 4, "stop at the first key that is not in the store: k1 is "
         "missing, so k2 and k3 (whose prefix includes block 1) cannot be used"),
        ({"k0", "k1"}, 17, 4, 4, "block 0 is already on the device (num_computed_tokens=4): "
         "start at block num_computed_tokens // block_size"),
        ({"k0", "k1", "k2", "k3"}, 16, 0, 12, "a prompt of exactly 4 blocks: the last token "
         "must be computed, so at most 3 blocks come from the store (k - 1)"),
    ]
    for store, total, computed, want, why in cases:
        got = call(num_matched_tokens, keys, store.__contains__, total, computed, 4)
        if got != want:
            raise CheckFailure("num_matched_tokens on a hand-worked case", inputs=f"keys "
                               f"{keys}, store {sorted(store)}, {total} prompt tokens, "
                               f"{computed} on the device, block_size 4", expected=want,
                               actual=got, hint=why)
    got = call(blocks_to_load, [7, 3, 9, 4, 1, 6], 8, 8, 4)
    if list(got) != [9, 4]:
        raise CheckFailure(
            "blocks_to_load picked other device blocks than the engine allocated for the matched "
            "tokens", inputs="block_table [7, 3, 9, 4, 1, 6], 8 tokens on the device, 8 to load, "
            "block_size 4", expected=[9, 4], actual=got,
            hint="the loaded tokens come right after the device-cached ones: block_table"
            "[num_computed_tokens // block_size :] for num_external_tokens // block_size "
            "blocks. Any other block holds another prefix's KV (or nothing yet).")


def check(block_keys: Callable, num_matched_tokens: Callable, blocks_to_load: Callable
          ) -> object:
    """The three functions in a real engine beside labkit's connector (see the module doc)."""

    def body() -> str:
        import torch

        from labkit.model.generate import generate
        from labkit.model.loader import load_pretrained

        _hand_cases(num_matched_tokens, blocks_to_load)
        model, tok = load_pretrained(MODEL, dtype=torch.float32, device="cpu")
        reqs = requests(tok)
        ref = _Recording()
        _run(ref, model, reqs)
        mine = LearnerConnector(block_keys, num_matched_tokens, blocks_to_load)
        got_out = _run(mine, model, reqs)
        if len(mine.matched) != len(ref.matched):
            raise CheckFailure("the engine asked your connector a different number of times",
                               expected=len(ref.matched), actual=len(mine.matched))
        _compare(mine.matched, ref.matched, reqs)
        for i, ((p, _), out) in enumerate(zip(reqs, got_out)):
            if out != generate(model, p, MAX_NEW, ignore_eos=True):
                raise CheckFailure("a greedy output differs from the reference generation",
                                   inputs=f"request {i}", actual=out, hint="the loaded KV is "
                                   "not the prompt's: check which blocks you load into.")
        hits = sum(ref.matched)
        return (f"your connector matched {hits} tokens from the CPU tier exactly where labkit's "
                f"does, kept tenant B out of tenant A's KV, and all {len(reqs)} outputs equal "
                "the reference.")

    return run_check("kv_connector", body)
