"""Chinese drill text, part 1 (the engine: KV cache, paging, batching, prefix caching,
scheduling, watermarks). Data only: drill id -> (question, answer).

Written the way a Chinese-speaking inference engineer answers in an interview: the field's
Chinese terms (KV 缓存, 分页注意力, 连续批处理, 首 token 延迟 ...) with the English names and
parameter names kept where engineers keep them. Every number of the English answer appears here
too (the tests check it), so the snippet that checks the English keeps this text honest.
"""

from __future__ import annotations

TOPICS_ZH: dict[str, str] = {
    "kv-cache": "KV 缓存", "paged-attention": "分页注意力", "batching": "连续批处理",
    "prefix-caching": "前缀缓存", "scheduling": "调度与抢占", "watermarks": "显存水位线",
    "quantization": "量化", "speculative-decoding": "投机解码", "metrics": "延迟指标",
    "moe": "混合专家 MoE", "llama-cpp": "llama.cpp 与 GGUF",
    "tensorrt-llm": "TensorRT-LLM 推理引擎",
    "frameworks": "推理框架选型", "compression": "模型压缩", "streaming": "流式输出",
    "structured-outputs": "结构化输出",
    "rate-limiting": "限流", "gpu-sharing": "GPU 共享", "releases": "灰度发布与热更新",
    "gateways": "模型网关", "autoscaling": "弹性扩缩容", "failover": "故障转移",
    "monitoring": "监控与长尾延迟", "multi-tenancy": "多租户隔离",
    "parallelism": "张量并行与流水线并行",
    "weight-loading": "权重加载与冷启动", "lora": "LoRA 部署", "on-device": "端侧部署",
    "safety": "内容安全审核",
}

ZH_CORE: dict[str, tuple[str, str]] = {
    "kv-size": (
        "Llama-2-7B 上一条 4k token 的序列要占多少 KV 缓存？为什么 Llama-3-8B 只要它的四分之一？",
        "每个 token 在每一层都要为每个 KV 头存一份 K 向量和一份 V 向量，所以每 token 的字节数是 "
        "2 x 层数 x KV 头数 x head_dim x 每元素字节数。Llama-2-7B（32 层、32 个 KV 头、head_dim "
        "128、fp16）每 token 512 KiB，4k token 就是 2 GiB。Llama-3-8B 用了分组查询注意力（GQA），"
        "32 个查询头共享 8 个 KV 头，每 token 只要 128 KiB：同样的显存能多放 4 倍的序列。",
    ),
    "kv-capacity": (
        "一张 A100-80GB 用 fp16 跑 Llama-2-7B，大概能放多少 token 的 KV 缓存？相当于多少个并发的 "
        "2k token 请求？",
        "vLLM 先按 gpu_memory_utilization（默认 0.9）划出一部分显存，减掉权重（约 13.5 GB）和一次"
        "profiling 试跑（按 max_num_batched_tokens 做一次前向）的激活值峰值显存，剩下的全部切成 KV "
        "块：不算激活值时约 64 GB / 512 KiB，大约 120k 个 token，也就是 60 个左右 2k token 的请求"
        "。labkit 的 max_kv_tokens 没有扣激活值，所以它的数字是上限；profiling 试跑通常还要再占几 "
        "GB。批大小远在算力打满之前就先被 KV 显存卡住了。",
    ),
    "paged-why": (
        "PagedAttention（分页注意力）解决的是什么问题？这个问题有多大？",
        "连续预分配 KV 时，每个请求都按最大长度预留，预留的大部分空间根本没用上（内部碎片）；大小"
        "不一的区域释放之后又把显存切得七零八落（外部碎片）。分页注意力把 KV 存进固定大小的块里，"
        "通过每条序列自己的块表（block table）找到它们，就像操作系统的虚拟内存分页：一条序列最多"
        "浪费一个没填满的块。在类似聊天的长度分布上，KV 显存利用率从远低于一半提升到 95% 以上。",
    ),
    "block-table": (
        "块表（block table）是什么？为什么一条序列的块不需要在显存里连续？",
        "块表把序列的第 i 个逻辑块（token i*B 到 i*B+B-1）映射到 KV 池里的一个物理块号。块从空闲"
        "链表里拿，谁先释放就先用谁，所以相邻的逻辑块在物理上通常隔得很远。注意力 kernel 读块表，"
        "再把每个块的 K、V 收集起来算，这也是分页注意力需要专门写 kernel 的原因。",
    ),
    "block-size": (
        "KV 块大小（block size）怎么选？",
        "块小，浪费少（平均每条序列浪费半个块），前缀共享的粒度也更细；块大，块表更短，kernel 效"
        "率更高（每个块是 kernel 一次加载的一个连续 tile）。vLLM 在 GPU 上默认 16 个 token 一块，"
        "在聊天类负载上浪费只有百分之几。",
    ),
    "batching-static": (
        "静态批处理和连续批处理相比，2-10 倍的吞吐差距是从哪里来的？",
        "静态批处理要等批里最长的请求跑完：先结束的请求留下空槽，新请求只能等整批结束。连续批处理"
        "（iteration-level batching，迭代级调度）每一步都重新组批：一条序列结束，它的槽位和 KV 块"
        "立刻交给等待队列里的请求。收益随输出长度的离散程度和批大小增大：长度完全相同就没有收益；"
        "模拟的 A100、聊天类长度、32 个槽位，大约 2 倍；长度分布更分散时会接近区间的上限。",
    ),
    "batching-why": (
        "为什么组批（batching）能让 decode 变快？",
        "生成一个 token 要把所有权重读一遍，但每个权重只做两次浮点运算，所以单条序列时 GPU 完全是"
        "访存瓶颈（在 A100 上，以 2 TB/s 读 13.5 GB 权重要 ~6.6 ms）。64 条序列共用这一次权重读取"
        "，一步的耗时几乎不变，产出却是 64 倍的 token，直到读 KV 或算力成为新的瓶颈。",
    ),
    "prefix-hash": (
        "推理引擎怎么判断两个请求可以共享 KV 块？",
        "每个填满的块都有一个键，由父块的键、本块的 token id 以及额外的键（比如租户的盐值）一起哈"
        "希得到（vLLM 的自动前缀缓存就是这么做的）。键相同，说明到这个块末尾为止的前缀完全一样，"
        "KV 也就一样，可以直接复用缓存里的物理块。最后一个没填满的块还没有键。SGLang 的基数树（"
        "radix tree）把同样的信息组织成一棵 token 序列树。",
    ),
    "prefix-ttft": (
        "请求共享一段很长的系统提示词时，前缀缓存能把首 token 延迟（TTFT）降多少？",
        "命中的块都不用再做 prefill，所以首 token 延迟大致按提示词里共享部分的比例下降（不算排队"
        "）。提示词大部分是共享的时，命中率接近共享比例，首 token 延迟能降一半甚至更多；省下了 "
        "prefill 的算力，吞吐也跟着上去。",
    ),
    "prefix-last-token": (
        "一个提示词全部命中缓存，而且正好按块对齐。引擎能完全跳过它的 prefill 吗？",
        "不能。下一个 token 的 logits 来自提示词最后一个位置的隐藏状态，而缓存里只有 K、V，没有这"
        "个隐藏状态，所以至少要把最后一个 token 重算一遍；提示词按块对齐时，引擎会复用除最后一个"
        "块以外的所有块。",
    ),
    "prefix-evict": (
        "请求结束后，它缓存的块会怎样？淘汰时先淘汰哪些？",
        "块的内容和键都保留，引用计数降到 0：可以被重新分配，但仍然能被查到。只有在没有真正空闲的"
        "块时，分配才会淘汰最久未使用（LRU）的缓存块。释放请求的块时从尾部往前放，这样一条链最前"
        "面的块（以后的提示词最可能共享的部分）留在缓存里的时间最长。",
    ),
    "sched-decode-first": (
        "连续批处理的一步里有 token 预算（token budget），先调度谁？为什么？",
        "先调度正在运行的 decode（每条一个 token）：它们便宜，而一旦被耽误，会直接表现为 TPOT 的"
        "尖刺。然后是还没做完的 prefill，再按策略顺序接纳等待队列里的请求；开了分块 prefill（"
        "chunked prefill）时，最后接纳的那条提示词拿走剩下的预算，长提示词就不会让 decode 整整停"
        "一步。这是 vLLM V1 调度器的做法，V0 调度器打开分块 prefill 时也是这样；V0 的默认调度器（"
        "不开分块 prefill）正好相反：先把能放下的等待中的 prefill 尽量组成一批，只有在没有 prefill "
        "的步里才跑 decode，所以一波长提示词会让所有正在输出的流一起卡住。decode 优先加分块 "
        "prefill 的组批方式，就是 Sarathi-Serve（OSDI'24）说的无停顿组批（stall-free batching）；"
        "另一种解法是把 prefill 和 decode 放到不同的 GPU 上，在它们之间传 KV（PD 分离，prefill/"
        "decode disaggregation），出自 DistServe（OSDI'24）和 Splitwise（ISCA'24）。",
    ),
    "sched-preempt": (
        "生成到一半 KV 块用完了。被抢占的请求是重算（recompute）还是换出（swap）？",
        "重算是直接释放被抢占请求的块，之后对它的提示词加上已经生成的 token 重新做一次 prefill；"
        "换出是把它的 KV 经 PCIe（~25 GB/s）拷到 CPU 内存，之后再拷回来。7B 模型、2k 上下文、"
        "A100 上，两者都是 100 ms 量级；prefill 的开销随上下文增长得比线性更快，所以长上下文时换"
        "出更划算，而重算不需要 CPU 内存池，也没有大量小块传输的开销。vLLM 的 V0 引擎两种都支持（"
        "默认重算，beam search 用换出）；V1 引擎抢占时只做重算，而且释放的块保留了前缀缓存的键，"
        "重算时经常能直接命中缓存。但 V1 里 KV 照样会搬到 CPU 内存，只是不再作为抢占方式：它的 "
        "KV 卸载连接器（offloading connector，--kv-offloading-size，native 或 LMCache 后端）把块"
        "拷到 CPU 内存池，请求（包括被重算的请求）在那里找到自己的前缀时再加载回来，用一次传输代"
        "替 prefill。哪个更便宜，还是上面那笔账。",
    ),
    "sched-sjf": (
        "FCFS、优先级调度、短作业优先（SJF）：哪个的平均等待时间最短？代价是什么？",
        "先服务短请求能让平均等待时间最短（经典结论），但长请求可能被饿死，所以生产环境的调度器会"
        "加老化（aging）机制，或者限制一个请求最多等多久。优先级调度让付费或交互式租户先走，同样"
        "有饿死的风险。FCFS 公平、可预期。",
    ),
    "watermark": (
        "准入控制里的 KV 高低水位线是什么？TGI 和 vLLM 实际是怎么做的？",
        "KV 快满的时候还接纳新请求，只会在之后引发抢占。教科书式的做法是迟滞（hysteresis）：使用"
        "率超过高水位线就停止接纳，降到低水位线以下才恢复，这样准入不会每一步都来回抖动，留出的余"
        "量也让运行中的序列能继续增长而不被抢占。各家服务器的实际做法不一样。TGI（2025 年十二月"
        "起进入维护模式，Hugging Face 现在推荐 vLLM 或 SGLang）按 token 预算准入："
        "只有在 max_batch_total_tokens 之内能为它的提示词加 max_new_tokens 预留出块（并且 "
        "prefill 放得进 max_batch_prefill_tokens），请求才会加入批次，所以运行中的请求永远不会缺 "
        "KV，也不会被抢占，代价是并发度：为 max_new_tokens 预留的块，大多数请求根本用不完；"
        "waiting_served_ratio（默认 0.3）和 max_waiting_tokens（默认 20）决定什么时候暂停 decode "
        "去给新请求做 prefill。vLLM 的 V0 块管理器只有一条水位线：分配之后至少还要剩 1% 的空闲块"
        "才接纳。它的 V1 引擎随 token 到来按需分配块，只要空闲块够就接纳，某个 decode 拿不到块时"
        "，抢占（重算）最后接纳的那个请求。",
    ),
}
