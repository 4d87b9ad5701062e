"""StreamResume on hand-written SSE events: what the client is sent, and the continuation
request the router builds when the replica dies (real processes: test_real_replicas.py)."""

import json

from labkit.router.failover import DONE, SSEBuffer, StreamResume, not_resumable
from labkit.serve import protocol


def ev(payload) -> bytes:
    return protocol.sse(payload)[:-2]  # SSEBuffer hands events without the blank line


def cmpl(text, ids, reason=None, prompt_ids=None, rid="cmpl-1", usage=False):
    ch = protocol.chunk("completion", rid, "m", 7, 0, text, reason, with_usage=usage)
    ch["choices"][0]["token_ids"] = ids
    if prompt_ids is not None:
        ch["choices"][0]["prompt_token_ids"] = prompt_ids
    return ch


def test_sse_buffer_joins_events_split_across_reads():
    b = SSEBuffer()
    assert b.feed(b"data: {\"a\"") == []
    assert b.feed(b": 1}\n\ndata: [DO") == [b'data: {"a": 1}']
    assert b.feed(b"NE]\n\n") == [b"data: [DONE]"]


def test_which_requests_can_be_resumed():
    assert not_resumable({"stream": True, "prompt": "x"}, False) is None
    assert not_resumable({"stream": True, "messages": []}, True) is None
    assert "stream" in not_resumable({"prompt": "x"}, False)
    assert not_resumable({"stream": True, "prompt": "x", "n": 2}, False) is None
    assert not_resumable({"stream": True, "prompt": "x", "stop": ["\n"]}, False) is None
    assert not_resumable({"stream": True, "prompt": ["a", "b"]}, False) is None
    # stop strings with several choices resume too (a common cut-back: the test below)
    assert not_resumable({"stream": True, "prompt": "x", "n": 2, "stop": "a"}, False) is None
    assert not_resumable({"stream": True, "prompt": ["a", "b"], "stop": "a"}, False) is None


def test_ids_the_router_added_are_stripped_and_id_only_chunks_dropped():
    s = StreamResume({"prompt": "x", "stream": True, "max_tokens": 5}, chat=False)
    assert json.loads(s.upstream_body())["return_token_ids"] is True
    out = s.on_event(ev(cmpl("ab", [1, 2], prompt_ids=[9, 9, 9])))
    # exactly what the replica sends without return_token_ids
    assert out == protocol.sse(protocol.chunk("completion", "cmpl-1", "m", 7, 0, "ab", None))
    assert s.on_event(ev(cmpl("", [3]))) is None  # held-back text: nothing visible yet
    assert s.prompt_ids == [9, 9, 9] and s.sent_ids == [1, 2, 3]


def test_resume_is_a_completion_over_prompt_and_sent_tokens_in_the_clients_identity():
    s = StreamResume({"prompt": "x", "stream": True, "max_tokens": 5, "temperature": 0,
                      "stream_options": {"include_usage": True}}, chat=False)
    s.on_event(ev(cmpl("ab", [1, 2], prompt_ids=[9, 9], usage=True)))
    body = json.loads(s.resume_body())
    assert body["prompt"] == [9, 9, 1, 2] and body["max_tokens"] == 3
    assert body["temperature"] == 0 and body["return_token_ids"] and body["stream"]
    # the continuation's chunks come back under the original id, with the usage fixed
    out = s.on_event(ev(cmpl("cd", [3, 4, 5], "length", rid="cmpl-OTHER", usage=True)))
    want = protocol.chunk("completion", "cmpl-1", "m", 7, 0, "cd", "length", with_usage=True)
    assert out == protocol.sse(want)
    use = s.on_event(ev(protocol.usage_chunk("completion", "cmpl-OTHER", "m", 8,
                                             protocol.usage(4, 3))))
    assert json.loads(use[6:])["usage"] == protocol.usage(2, 5)
    assert json.loads(use[6:])["id"] == "cmpl-1"
    assert s.on_event(b"data: [DONE]") == DONE and s.done


def test_chat_continues_as_chat_chunks_and_max_tokens_defaults_to_the_context():
    s = StreamResume({"messages": [{"role": "user", "content": "hi"}], "stream": True},
                     chat=True)
    role = protocol.chunk("chat", "chat-1", "m", 7, 0, None, None, role=True)
    role["choices"][0]["prompt_token_ids"] = [5, 6, 7]
    assert s.on_event(ev(role)) == protocol.sse(
        protocol.chunk("chat", "chat-1", "m", 7, 0, None, None, role=True))
    c = protocol.chunk("chat", "chat-1", "m", 7, 0, "x", None)
    c["choices"][0]["token_ids"] = [11]
    s.on_event(ev(c))
    assert s.needs_max_model_len()
    body = json.loads(s.resume_body(max_model_len=20))
    assert body["prompt"] == [5, 6, 7, 11] and body["max_tokens"] == 20 - 3 - 1
    assert "messages" not in body
    out = s.on_event(ev(cmpl("y", [12], "stop", rid="cmpl-9")))
    assert out == protocol.sse(protocol.chunk("chat", "chat-1", "m", 7, 0, "y", "stop"))


def test_a_replica_dying_after_the_last_token_is_finished_by_the_router():
    s = StreamResume({"prompt": "x", "stream": True, "max_tokens": 2,
                      "stream_options": {"include_usage": True}}, chat=False)
    s.on_event(ev(cmpl("ab", [1, 2], "length", prompt_ids=[9], usage=True)))
    tail = s.tail_if_finished()
    assert tail.endswith(DONE)
    assert json.loads(tail.split(b"\n\n")[0][6:])["usage"] == protocol.usage(1, 2)
    s2 = StreamResume({"prompt": "x", "stream": True, "max_tokens": 4}, chat=False)
    s2.on_event(ev(cmpl("ab", [1, 2], prompt_ids=[9])))
    assert s2.tail_if_finished() is None  # 2 tokens still owed: resume instead
    err = json.loads(s2.error_tail("gone").split(b"\n\n")[0][6:])
    assert err["error"]["code"] == "upstream_failed"


def test_output_without_prompt_ids_is_not_retried_blindly():
    s = StreamResume({"prompt": "x", "stream": True}, chat=False)
    assert s.cannot_resume() is None  # nothing sent yet: a plain retry is safe
    s.on_event(b'data: {"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}')
    assert "prompt_token_ids" in s.cannot_resume()


def test_stop_strings_cut_back_to_text_the_client_has_entirely():
    """stop "XYZ": the replica holds back 2 characters, so after each event its decoded text is
    exactly 2 longer than what was shown. The continuation starts at the last token count whose
    text was all shown; the regenerated ids and characters the client has are dropped."""
    s = StreamResume({"prompt": "x", "stream": True, "max_tokens": 6, "stop": "XYZ",
                      "return_token_ids": True}, chat=False)
    s.on_event(ev(cmpl("", [1], prompt_ids=[9])))  # "ab" decoded, all held
    s.on_event(ev(cmpl("ab", [2])))  # "abcd": "ab" shown, "cd" held -> 2 tokens = 4 chars
    s.on_event(ev(cmpl("cd", [3])))  # "abcdef": 3 tokens = 6 chars; shown 4
    assert s.choices[0].marks == [(0, 0), (2, 4), (3, 6)]
    body = json.loads(s.resume_body())
    assert body["prompt"] == [9, 1, 2] and body["max_tokens"] == 4 and body["stop"] == "XYZ"
    # the survivor regenerates token 3 ("ef"): shows nothing new yet, then "ef" + "g"
    assert s.on_event(ev(cmpl("", [3], rid="cmpl-2"))) is None  # a regenerated id: dropped
    out = s.on_event(ev(cmpl("efg", [4], rid="cmpl-2")))
    sent = json.loads(out[6:])["choices"][0]
    assert sent["text"] == "efg" and sent["token_ids"] == [4]
    assert s.choices[0].text == "abcdefg" and s.sent_ids == [1, 2, 3, 4]
    # had it regenerated different text (sampling), the router says so instead of showing it
    t = StreamResume({"prompt": "x", "stream": True, "max_tokens": 6, "stop": "XYZ"}, False)
    t.on_event(ev(cmpl("abc", [1, 2], prompt_ids=[9])))
    t.resume_body()
    err = t.on_event(ev(cmpl("abQ", [1, 5], rid="cmpl-2")))
    assert b"regenerated differently" in err and t.done


def test_several_choices_continue_as_one_completion_mapped_back_by_index():
    s = StreamResume({"prompt": ["p", "q"], "stream": True, "max_tokens": 4, "n": 2}, False)
    for i, (pid, toks) in enumerate([([7], [1, 2]), ([7], [3]), ([8, 8], [4, 5]),
                                     ([8, 8], [6])]):
        c = cmpl("t" * len(toks), toks, prompt_ids=pid)
        c["choices"][0]["index"] = i
        s.on_event(ev(c))
    fin = cmpl("", [], "length")
    fin["choices"][0]["index"] = 2
    s.choices[2].ids += [10, 11]  # choice 2 used its 4 tokens and finished
    s.on_event(ev(fin))
    body = json.loads(s.resume_body())
    assert body["prompt"] == [[7, 1, 2], [7, 3], [8, 8, 6]] and "n" not in body
    assert body["max_tokens"] == 3  # the largest budget left (choices 1 and 3)
    c = cmpl("u", [20])
    c["choices"][0]["index"] = 1  # the continuation's choice 1 is the client's choice 1
    out = json.loads(s.on_event(ev(c))[6:])["choices"][0]
    assert out["index"] == 1 and out["text"] == "u"
    c = cmpl("vw", [21, 22])
    c["choices"][0]["index"] = 0  # client's choice 0 had 2 tokens left: ends with "length"
    out = json.loads(s.on_event(ev(c))[6:])["choices"][0]
    assert out["index"] == 0 and out["finish_reason"] == "length"
    c = cmpl("x", [23])
    c["choices"][0]["index"] = 0
    assert s.on_event(ev(c)) is None  # past its budget: the router already ended it
    c = cmpl("y", [24])
    c["choices"][0]["index"] = 2  # the client's choice 3
    assert json.loads(s.on_event(ev(c))[6:])["choices"][0]["index"] == 3


def test_a_bad_n_is_left_to_the_replica_to_reject():
    for n in ("2", None, 0, True, 10**9):
        s = StreamResume({"prompt": "x", "stream": True, "n": n}, chat=False)
        assert list(s.choices) == [0]


def test_stop_strings_with_several_choices_cut_back_to_one_common_exact_count():
    """stop "XYZ" (2 characters held) over n = 2. Events of one step reach the router one
    choice at a time, so the two choices stand at different counts when the replica dies:
    choice 0 was shown "abcd" of 3 tokens (exact counts 0, 2), choice 1 "abcdef" of 4 (0, 2,
    3). Both continue from 2 tokens, so one max_tokens (6 - 2) is each one's exact budget, and
    the replica ends each one itself."""
    s = StreamResume({"prompt": "x", "stream": True, "max_tokens": 6, "stop": "XYZ", "n": 2,
                      "return_token_ids": True}, chat=False)

    def on(i, text, ids, pids=None, rid="cmpl-1", reason=None):
        c = cmpl(text, ids, reason, prompt_ids=pids, rid=rid)
        c["choices"][0]["index"] = i
        return s.on_event(ev(c))

    for i in (0, 1):
        on(i, "", [1], [9])  # "ab" decoded, all held
        on(i, "ab", [2])  # 2 tokens = 4 characters, 2 shown
        on(i, "cd", [3 + i])  # 3 tokens = 6 characters, 4 shown
    on(1, "ef", [5])  # choice 1 is one token ahead: 4 tokens = 8 characters, 6 shown
    body = json.loads(s.resume_body())
    assert body["prompt"] == [[9, 1, 2], [9, 1, 2]] and body["max_tokens"] == 4
    assert body["stop"] == "XYZ" and "n" not in body
    assert (s.choices[0].skip_ids, s.choices[0].verify) == (1, "")
    assert (s.choices[1].skip_ids, s.choices[1].verify) == (2, "ef")
    # choice 0: token 3 regenerated (its text held, then shown: the client never had "ef")
    assert on(0, "", [3], rid="cmpl-2") is None
    out = json.loads(on(0, "ef", [6], rid="cmpl-2")[6:])["choices"][0]
    assert out["index"] == 0 and out["text"] == "ef" and out["token_ids"] == [6]
    # choice 1: tokens 4 and 5 and "ef" regenerated and dropped, then its own text and end
    assert on(1, "", [4], rid="cmpl-2") is None and on(1, "ef", [5], rid="cmpl-2") is None
    out = json.loads(on(1, "gh", [7], rid="cmpl-2", reason="stop")[6:])["choices"][0]
    assert out["index"] == 1 and out["text"] == "gh" and out["finish_reason"] == "stop"
    assert s.choices[1].text == "abcdefgh" and s.choices[1].ids == [1, 2, 4, 5, 7]
    assert s.choices[0].text == "abcdef" and s.choices[0].ids == [1, 2, 3, 6]
    # a choice with nothing shown yet pulls every choice back to the prompt (exact for all)
    t = StreamResume({"prompt": ["p", "q"], "stream": True, "max_tokens": 5, "stop": "XYZ"},
                     chat=False)
    for i, pid in ((0, [7]), (1, [8])):
        c = cmpl("ab" if i == 0 else "", [1, 2] if i == 0 else [3], prompt_ids=pid)
        c["choices"][0]["index"] = i
        t.on_event(ev(c))
    body = json.loads(t.resume_body())
    assert body["prompt"] == [[7], [8]] and body["max_tokens"] == 5
    assert t.choices[0].skip_ids == 2 and t.choices[0].verify == "ab"


def test_a_choice_still_queued_continues_from_its_prompt_as_sent():
    """Two prompts; the replica dies before prompt "q" started (queued behind max_num_seqs):
    the router never got its ids, so that choice continues from the client's own text, and its
    ids are taken from the continuation's first chunk (usage counts them)."""
    s = StreamResume({"prompt": ["p", "q"], "stream": True, "max_tokens": 4,
                      "stream_options": {"include_usage": True}}, chat=False)
    s.on_event(ev(cmpl("ab", [1, 2], prompt_ids=[7])))
    assert s.cannot_resume() is None
    body = json.loads(s.resume_body())
    assert body["prompt"] == [[7, 1, 2], "q"] and body["max_tokens"] == 4
    c = cmpl("z", [5], prompt_ids=[8, 8])
    c["choices"][0]["index"] = 1  # the continuation's choice 1 is the client's choice 1
    out = json.loads(s.on_event(ev(c))[6:])["choices"][0]
    assert out["index"] == 1 and out["text"] == "z" and "prompt_token_ids" not in out
    assert s.prompts == {0: [7], 1: [8, 8]}
    use = json.loads(s._usage_event()[6:])["usage"]
    assert use["prompt_tokens"] == 3 and use["completion_tokens"] == 3
    # one prompt only (nothing to fall back on): output without ids is still not replayed
    t = StreamResume({"prompt": "p", "stream": True}, chat=False)
    t.on_event(b'data: {"choices": [{"index": 0, "text": "hi", "finish_reason": null}]}')
    assert "prompt_token_ids" in t.cannot_resume()
