"""Drill bank, part 1: the inference engine (KV cache, paging, batching, prefix caching,
scheduling, quantization, speculative decoding). Data only; ``drills.py`` searches and runs it.

Each snippet runs with labkit alone in a few hundred milliseconds and asserts the claim its
answer makes, so the test suite keeps every number in these answers honest.
"""

from __future__ import annotations

from dataclasses import dataclass
from textwrap import dedent


@dataclass(frozen=True)
class Claim:
    """One statement a drill makes about a named system, and where that system says so (a
    repository path at the file that implements it, or the documentation page)."""

    system: str
    claim: str
    source: str


@dataclass(frozen=True)
class Drill:
    id: str
    topic: str
    question: str
    answer: str
    snippet: str | None = None
    # Filled in by ``drills.py`` from ``drills_zh_*`` (the Chinese text an interviewer in China
    # would hear) and ``drills_sources`` (the audited claims about named systems).
    question_zh: str = ""
    answer_zh: str = ""
    claims: tuple[Claim, ...] = ()


def d(id: str, topic: str, question: str, answer: str, snippet: str | None = None) -> Drill:
    return Drill(id, topic, " ".join(question.split()), " ".join(answer.split()),
                 dedent(snippet).strip() if snippet else None)


CORE = [
    d("kv-size", "kv-cache",
      "How much KV cache does one 4k-token sequence need on Llama-2-7B, and why does "
      "Llama-3-8B need four times less?",
      "Per token every layer stores a K and a V vector for every KV head: 2 x layers x kv_heads x "
      "head_dim x bytes. Llama-2-7B (32 layers, 32 KV heads, dim 128, fp16) needs 512 KiB per "
      "token, 2 GiB for 4k tokens. Llama-3-8B uses grouped-query attention with 8 KV heads shared "
      "by 32 query heads, so 128 KiB per token: 4x more sequences fit in the same memory.",
      """
      from labkit.sim.presets import get_model_preset
      for name in ("llama-2-7b", "llama-3-8b"):
          per_token = get_model_preset(name).kv_bytes_per_token
          print(f"{name}: {per_token / 2**10:.0f} KiB/token, "
                f"4k tokens: {per_token * 4096 / 2**30:.2f} GiB")
      assert get_model_preset("llama-2-7b").kv_bytes_per_token == 512 * 2**10
      assert get_model_preset("llama-3-8b").kv_bytes_per_token == 128 * 2**10
      """),
    d("kv-capacity", "kv-cache",
      "An A100-80GB serves Llama-2-7B in fp16. Roughly how many tokens of KV cache fit, and how "
      "many concurrent 2k-token requests is that?",
      "vLLM reserves a fraction of GPU memory (gpu_memory_utilization, 0.9 by default), subtracts "
      "the weights (about 13.5 GB) and the peak activation memory of a profiling run (a forward "
      "pass at max_num_batched_tokens), and fills the rest with KV blocks: about 64 GB / 512 KiB "
      "= roughly 120k tokens before activations, so about 60 requests of 2k tokens. labkit's "
      "max_kv_tokens ignores the activations, so its number is an upper bound; the profiling run "
      "typically takes a few GB more. Batch size is bounded by KV memory long before compute.",
      """
      from labkit.sim.cost import max_kv_tokens
      tokens = max_kv_tokens("llama-2-7b", "a100-80gb", gpu_memory_utilization=0.9)
      print(f"{tokens} tokens of KV -> {tokens // 2048} concurrent 2k-token requests")
      assert 110_000 < tokens < 130_000
      """),
    d("paged-why", "paged-attention",
      "What problem does PagedAttention solve, and how big is it?",
      "Contiguous KV pre-allocation reserves the maximum length for every request, so most of the "
      "reservation holds nothing (internal fragmentation) and freed regions of different sizes "
      "fragment memory (external fragmentation). PagedAttention stores KV in fixed-size blocks "
      "found through a per-sequence block table, like virtual-memory pages: a sequence wastes at "
      "most one partly filled block. On a chat-like length distribution this takes KV "
      "utilization from well under half to above 95%.",
      """
      from labkit.sim.workloads import get_workload
      reqs = get_workload("chat").sample(1000, seed=0)
      lengths = [r.prompt_len + r.output_len for r in reqs]
      max_len = max(lengths)  # the kindest case for contiguous allocation
      contiguous = sum(lengths) / (len(lengths) * max_len)
      block = 16
      paged = sum(lengths) / sum(-(-n // block) * block for n in lengths)
      print(f"contiguous {contiguous:.1%}  paged (block {block}) {paged:.1%}")
      assert contiguous < 0.5 and paged > 0.95
      """),
    d("block-table", "paged-attention",
      "What is a block table, and why do a sequence's blocks not need to be contiguous?",
      "A block table maps a sequence's logical block i (tokens i*B .. i*B+B-1) to a physical block "
      "id in the KV pool. Blocks come from a free list in whatever order they were freed, so "
      "neighbouring logical blocks usually live far apart. The attention kernel reads the table "
      "and gathers each block's K and V, which is why paged attention needs its own kernel.",
      """
      from labkit.kv.block_pool import BlockPool
      pool = BlockPool(num_blocks=8)
      tables = {"a": [], "b": []}
      for seq in ["a", "b", "a", "b", "a"]:  # two sequences growing in turn
          tables[seq].append(pool.allocate()[0])
      print(tables)
      assert tables["a"] == [0, 2, 4]  # interleaved: not contiguous
      """),
    d("block-size", "paged-attention",
      "How do you choose the KV block size?",
      "Small blocks waste less (on average half a block per sequence) and share prefixes at a "
      "finer grain; large blocks make block tables shorter and kernels more efficient (each block "
      "is a contiguous tile the kernel loads at once). vLLM uses 16 tokens on GPUs; with that the "
      "waste is a few percent of a chat workload.",
      """
      from labkit.sim.workloads import get_workload
      lengths = [r.prompt_len + r.output_len for r in get_workload("chat").sample(1000, seed=0)]
      for block in (1, 8, 16, 32, 128):
          reserved = sum(-(-n // block) * block for n in lengths)
          print(f"block {block:>3}: waste {1 - sum(lengths) / reserved:.2%}")
      waste16 = 1 - sum(lengths) / sum(-(-n // 16) * 16 for n in lengths)
      assert waste16 < 0.05
      """),
    d("batching-static", "batching",
      "Static versus continuous batching: where does the 2-10x throughput difference come from?",
      "A static batch runs until its longest request finishes; finished requests leave idle "
      "slots and new ones wait for the whole batch. Continuous (iteration-level) batching "
      "re-forms the batch every step: a finished sequence's slot and blocks go to a waiting "
      "request immediately. The gain grows with the spread of output lengths and the batch "
      "size: equal lengths gain nothing; a simulated A100 on chat-like lengths with 32 slots "
      "gains about 2x, and wider length spreads push it towards the upper end of the range.",
      """
      from labkit.sim.simulate import simulate
      tps = {}
      for batching in ("static", "continuous"):
          r = simulate(model="llama-2-7b", gpu="a100-80gb", workload="chat", num_requests=120,
                       max_num_seqs=32, batching=batching, seed=0)
          tps[batching] = r.metrics["tokens_per_s"]
          print(f"{batching:>10}: {tps[batching]:6.0f} tokens/s, "
                f"TTFT p50 {r.metrics['ttft']['p50']:.1f} s")
      print(f"continuous / static = {tps['continuous'] / tps['static']:.1f}x (simulated A100)")
      assert tps["continuous"] > 1.5 * tps["static"]
      """),
    d("batching-why", "batching",
      "Why does batching make decode faster at all?",
      "Decoding one token reads every weight once but does only two FLOPs per weight, so one "
      "sequence leaves the GPU memory-bound (on an A100, 13.5 GB of weights take ~6.6 ms to read "
      "at 2 TB/s). Sixty-four sequences reuse the same weight read, so the step costs about the "
      "same and produces 64x the tokens, until the KV reads or compute take over.",
      """
      from labkit.sim.cost import step_time
      for batch in (1, 16, 64, 256):
          t = step_time("llama-2-7b", "a100-80gb", 0, batch, context_tokens=batch * 512)
          print(f"batch {batch:>3}: step {t * 1e3:5.1f} ms, {batch / t:7.0f} tokens/s")
      t1 = step_time("llama-2-7b", "a100-80gb", 0, 1, 512)
      t64 = step_time("llama-2-7b", "a100-80gb", 0, 64, 64 * 512)
      assert 64 / t64 > 20 * (1 / t1)
      """),
    d("prefix-hash", "prefix-caching",
      "How does an engine know two requests can share KV blocks?",
      "Each full block gets a key hashed from its parent block's key, its own token ids and extra "
      "keys such as a tenant salt (vLLM's automatic prefix caching). Equal keys mean equal "
      "prefixes up to the end of that block, so the KV is identical and the cached physical "
      "block is reused. A partial last block has no key yet. SGLang's radix tree indexes the "
      "same information as a tree of token sequences.",
      """
      from labkit.kv.prefix import hash_prompt_blocks
      system = list(range(100, 164))  # a 64-token shared system prompt
      a = hash_prompt_blocks(system + [1, 2, 3, 4, 5], block_size=16)
      b = hash_prompt_blocks(system + [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9], 16)
      shared = sum(x == y for x, y in zip(a, b))
      print(f"{len(a)} and {len(b)} full blocks, {shared} shared")
      assert shared == 4
      """),
    d("prefix-ttft", "prefix-caching",
      "How much does prefix caching cut TTFT when requests share a long system prompt?",
      "A hit skips the prefill of every cached block, so TTFT shrinks roughly in proportion to "
      "the shared fraction of the prompt (queueing aside). With most of each prompt shared the "
      "hit rate approaches the shared fraction and TTFT drops by a factor of two or more; "
      "throughput rises too because prefill compute is saved.",
      """
      from labkit.sim.simulate import simulate
      ttft = {}
      for caching in (False, True):
          r = simulate(model="llama-2-7b", gpu="a100-80gb", workload="shared-prefix",
                       num_requests=100, arrival_rate=5.0, enable_prefix_caching=caching, seed=0)
          ttft[caching] = r.metrics["ttft"]["p50"]
          print(f"prefix caching {'on ' if caching else 'off'}: TTFT p50 "
                f"{ttft[caching] * 1e3:.1f} ms, hit rate {r.stats['prefix_hit_rate']:.0%}")
      assert ttft[True] < 0.6 * ttft[False]
      """),
    d("prefix-last-token", "prefix-caching",
      "A prompt is fully cached and block-aligned. Does the engine skip its prefill entirely?",
      "No. The next token's logits come from the last prompt position's hidden state, which the "
      "cache does not store, so at least the last token is recomputed; with block-aligned prompts "
      "the engine reuses all but the last block.",
      """
      from labkit.exercises.solutions import longest_cached_prefix
      hashes = ["k0", "k1", "k2"]
      cached = {"k0": 7, "k1": 3, "k2": 5}
      print(longest_cached_prefix(hashes, 48, 16, cached), "of", len(hashes), "blocks reused")
      assert longest_cached_prefix(hashes, 48, 16, cached) == [7, 3]
      assert longest_cached_prefix(hashes, 49, 16, cached) == [7, 3, 5]
      """),
    d("prefix-evict", "prefix-caching",
      "What happens to cached blocks when their requests finish, and which are evicted first?",
      "They keep their contents and key with ref count 0: free to reuse, but still findable. Only "
      "when no truly free block is left does allocation evict the least recently used cached "
      "block. Freeing a request's blocks tail first keeps a chain's first blocks, which the most "
      "future prompts share, cached the longest.",
      """
      from labkit.kv.block_pool import BlockPool
      pool = BlockPool(num_blocks=2)
      b0, _ = pool.allocate()
      b1, _ = pool.allocate()
      pool.register(b0, b"key-0")
      pool.register(b1, b"key-1")
      pool.free(b1)
      pool.free(b0)  # b1 freed first = least recently used
      block, evicted = pool.allocate()
      print(f"allocated {block}, evicted {evicted}; key-0 still cached: {pool.lookup(b'key-0')}")
      assert evicted == b1 and pool.lookup(b"key-0") == b0
      """),
    d("sched-decode-first", "scheduling",
      "In one continuous-batching step with a token budget, who gets scheduled first and why?",
      "Running decodes first (one token each): they are cheap and delaying them shows up directly "
      "as TPOT spikes. Then unfinished prefills, then waiting requests in policy order; with "
      "chunked prefill the last admitted prompt gets whatever budget is left, so long prompts "
      "never stall decodes for a whole step. That is vLLM's V1 scheduler, and its V0 scheduler "
      "with chunked prefill enabled; V0's default scheduler (chunked prefill off) did the "
      "opposite: it batched as many waiting prefills as fit first and ran the decodes only in "
      "steps with no prefill, so a burst of long prompts stalled every running stream. Decode-"
      "first batching with chunked prefill is what Sarathi-Serve (OSDI'24) calls stall-free "
      "batching; the other cure, running prefill and decode on different GPUs and shipping the "
      "KV between them (prefill/decode disaggregation), comes from DistServe (OSDI'24) and "
      "Splitwise (ISCA'24).",
      """
      from labkit.exercises.scheduler_step import Seq
      from labkit.exercises.solutions import schedule_step
      running = [Seq("chat-1", 30, 35), Seq("chat-2", 12, 12)]
      waiting = [Seq("long-doc", 3000), Seq("short", 20)]
      plan = schedule_step(running, waiting, token_budget=512, max_num_seqs=8)
      print(plan)
      assert plan == {"chat-1": 1, "chat-2": 1, "long-doc": 510}
      """),
    d("sched-preempt", "scheduling",
      "KV blocks run out mid-generation. Recompute or swap the victim?",
      "Recompute drops the victim's blocks and later re-runs prefill over its prompt plus the "
      "tokens generated so far; swap copies its KV to CPU memory over PCIe (~25 GB/s) and back. "
      "For a 7B model with a 2k context on an A100 both cost on the order of 100 ms; prefill cost "
      "grows faster than linearly with context, so swap gains on long contexts, while recompute "
      "needs no CPU pool and no small-transfer overhead. vLLM's V0 engine offered both "
      "(recompute by default, swap for beam search); its V1 engine only preempts by recompute, "
      "and since freed blocks keep their prefix-cache keys, the recompute often hits the cache. "
      "KV still moves to CPU memory in V1, just not as a preemption mode: its offloading KV "
      "connector (--kv-offloading-size, native or LMCache backend) copies blocks to a CPU pool "
      "and loads them back when a request, a recomputed one included, finds its prefix there, "
      "so a transfer replaces the prefill. Which is cheaper is the same trade-off as above.",
      """
      from labkit.sim.cost import step_time
      from labkit.sim.presets import get_model_preset
      kv_per_token = get_model_preset("llama-2-7b").kv_bytes_per_token
      ratios = []
      for ctx in (512, 2048, 8192):
          recompute = step_time("llama-2-7b", "a100-80gb", ctx, 0, 0)
          swap = 2 * kv_per_token * ctx / 25e9  # out and back in
          ratios.append(recompute / swap)
          print(f"context {ctx:>5}: recompute {recompute * 1e3:6.1f} ms, swap {swap * 1e3:6.1f} ms")
      assert ratios[0] < ratios[-1] and 0.2 < ratios[1] < 5
      """),
    d("sched-sjf", "scheduling",
      "FCFS, priority or shortest-job-first: which minimises mean waiting time, and at what cost?",
      "Serving short requests first minimises mean waiting time (a classic result), but long "
      "requests can starve, so production schedulers add aging or cap how long a request may "
      "wait. Priority scheduling serves paying or interactive tenants first with the same "
      "starvation risk. FCFS is fair and predictable.",
      """
      from labkit.sim.workloads import get_workload
      jobs = [r.prompt_len for r in get_workload("chat").sample(200, seed=1)]
      def mean_wait(order):
          t = waits = 0
          for j in order:
              waits += t
              t += j
          return waits / len(order)
      fcfs, sjf = mean_wait(jobs), mean_wait(sorted(jobs))
      print(f"mean wait (token-time units): FCFS {fcfs:.0f}, SJF {sjf:.0f}")
      assert sjf < fcfs
      """),
    d("watermark", "watermarks",
      "What are high and low KV watermarks in admission control, and what do TGI and vLLM "
      "actually do?",
      "Admitting new requests while KV usage is near full just causes preemptions later. The "
      "textbook technique is hysteresis: stop admitting when usage crosses a high watermark and "
      "resume only below a lower one, so admission does not flap on and off every step and the "
      "headroom lets running sequences grow without being preempted. The servers differ. TGI "
      "(in maintenance mode since December 2025; Hugging Face now recommends vLLM or SGLang) "
      "admits by token budget: a request joins the batch only if blocks for its prompt plus "
      "max_new_tokens can be reserved within max_batch_total_tokens (and its prefill fits "
      "max_batch_prefill_tokens), so a running request never runs out of KV and is never "
      "preempted, at the price of concurrency (blocks held for max_new_tokens that most requests "
      "never use); waiting_served_ratio (default 0.3) and max_waiting_tokens (default 20) decide "
      "when decoding pauses to prefill newcomers. vLLM's V0 block manager kept a single "
      "watermark: admit only if 1% of the blocks stay free after the allocation. Its V1 engine "
      "allocates blocks as tokens arrive, admits while enough blocks are free, and preempts "
      "(recomputes) the last admitted request when a decode finds none.",
      """
      def admit_trace(usage, high=0.9, low=0.7):  # hysteresis: the textbook technique
          admitting, out = True, []
          for u in usage:
              if admitting and u >= high:
                  admitting = False
              elif not admitting and u <= low:
                  admitting = True
              out.append(admitting)
          return out
      usage = [0.5, 0.8, 0.91, 0.88, 0.85, 0.75, 0.69, 0.8, 0.92]
      flags = admit_trace(usage)
      print(list(zip(usage, flags)))
      assert flags == [True, True, False, False, False, False, True, True, False]

      import random
      def serve(reserve, blocks=64, block_size=16):
          # TGI-like: reserve prompt + max_new_tokens up front; vLLM-like: blocks on demand,
          # preempt the last admitted request (it is recomputed when readmitted)
          rng = random.Random(0)
          reqs = [(100, 300, rng.randint(20, 300)) for _ in range(16)]  # prompt, max_new, actual
          need = lambda tokens: -(-tokens // block_size)
          waiting, running, held, made = list(range(16)), [], {}, [0] * 16
          free, peak, preempted = blocks, 0, 0
          while waiting or running:
              while waiting:
                  prompt, max_new, _ = reqs[waiting[0]]
                  want = need(prompt + (max_new if reserve else made[waiting[0]] + 1))
                  if want > free:
                      break
                  i = waiting.pop(0)
                  free, held[i] = free - want, want
                  running.append(i)
              peak = max(peak, len(running))
              for i in list(running):
                  if i not in running:  # preempted earlier in this step
                      continue
                  prompt, _, actual = reqs[i]
                  made[i] += 1
                  if need(prompt + made[i]) > held[i]:  # only on demand: a new block
                      while free == 0 and i in running:
                          victim = running.pop()
                          free += held.pop(victim)
                          waiting.insert(0, victim)
                          preempted += 1
                      if i not in running:
                          continue
                      free, held[i] = free - 1, held[i] + 1
                  if made[i] == actual:
                      running.remove(i)
                      free += held.pop(i)
          return peak, preempted
      tgi, vllm = serve(reserve=True), serve(reserve=False)
      print(f"reserve prompt + max_new_tokens: {tgi[0]} running at most, {tgi[1]} preemptions; "
            f"blocks on demand: {vllm[0]} running at most, {vllm[1]} preemptions")
      assert tgi[1] == 0 and vllm[0] > tgi[0] and vllm[1] > 0
      """),
]
