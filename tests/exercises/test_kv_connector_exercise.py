"""The KV-connector exercise in the real engine: the reference passes; a count that takes the
prompt's last block whole, keys without the salt, unchained keys, a count that skips a miss,
and loads into the wrong device blocks are each rejected with a message naming the mistake."""

from __future__ import annotations

import pytest

from labkit.exercises import kv_connector as K
from labkit.exercises import kv_connector_solutions as S


def keys_without_salt(token_ids, block_size, salt, hash_block):
    return S.block_keys(token_ids, block_size, None, hash_block)


def keys_unchained(token_ids, block_size, salt, hash_block):
    return [hash_block(None, token_ids[i * block_size:(i + 1) * block_size], salt)
            for i in range(len(token_ids) // block_size)]


def count_takes_last_block(keys, in_store, num_prompt_tokens, num_computed_tokens, block_size):
    n = 0
    for key in keys[num_computed_tokens // block_size:]:
        if not in_store(key):
            break
        n += 1
    return n * block_size


def count_skips_misses(keys, in_store, num_prompt_tokens, num_computed_tokens, block_size):
    last = (num_prompt_tokens - 1) // block_size
    return sum(in_store(k) for k in keys[num_computed_tokens // block_size:last]) * block_size


def count_from_block_zero(keys, in_store, num_prompt_tokens, num_computed_tokens, block_size):
    return S.num_matched_tokens(keys, in_store, num_prompt_tokens, 0, block_size)


def load_from_first_block(block_table, num_computed_tokens, num_external_tokens, block_size):
    return block_table[:num_external_tokens // block_size]


@pytest.fixture(autouse=True)
def _progress(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))


def test_reference_passes_and_the_workload_exercises_every_case():
    result = K.check(S.block_keys, S.num_matched_tokens, S.blocks_to_load)
    assert result.passed, result.message
    ref = K._Recording()
    from labkit.model.loader import load_pretrained

    model, tok = load_pretrained(K.MODEL)
    reqs = K.requests(tok)
    K._run(ref, model.float(), reqs)
    m = ref.matched
    assert m[0] == m[1] == m[2] == 0  # nothing stored yet
    assert m[3] > 0  # the first document again: from the CPU tier
    assert m[4] == 0  # the same prompt for another tenant: nothing
    assert len(reqs[5][0]) % K.BS == 0 and m[5] == len(reqs[5][0]) - K.BS  # last block kept
    assert m[7] == 0  # blocks stored under another prefix: chained keys never match them


@pytest.mark.parametrize("fns,words", [
    ((S.block_keys, count_takes_last_block, S.blocks_to_load), ["last token", "k - 1"]),
    ((keys_without_salt, S.num_matched_tokens, S.blocks_to_load), ["salt", "tenant B"]),
    ((keys_unchained, S.num_matched_tokens, S.blocks_to_load), ["chained"]),
    ((S.block_keys, count_skips_misses, S.blocks_to_load), ["first key that is not"]),
    ((S.block_keys, count_from_block_zero, S.blocks_to_load), ["num_computed_tokens //"]),
    ((S.block_keys, S.num_matched_tokens, load_from_first_block), ["engine allocated"]),
], ids=["last-block", "no-salt", "unchained", "skips-misses", "from-zero", "wrong-blocks"])
def test_wrong_answers_rejected(fns, words):
    result = K.check(*fns)
    assert not result.passed
    for w in words:
        assert w in result.message, result.message


def test_untouched_stub_is_not_an_attempt():
    def stub(*a):
        raise NotImplementedError("write block_keys")

    result = K.check(stub, S.num_matched_tokens, S.blocks_to_load)
    assert not result.passed and "not implemented yet" in result.message
