"""Chinese drill text, part 5 (LoRA adapters, QLoRA deployment, phones and NPUs, safety review).
Data only: drill id -> (question, answer); see ``drills_zh_core``."""

from __future__ import annotations

ZH_DEPLOY: dict[str, tuple[str, str]] = {
    "lora-memory": (
        "Llama-2-7B 的一个 LoRA 适配器占多少显存？一份基座模型旁边能放多少个？",
        "LoRA 把冻结的权重 W [out, in] 换成 W + (alpha/r) x B x A，其中 A [r, in]、B [out, r]，所"
        "以一个适配器在每个被适配的矩阵上只多 r x (in + out) 个参数，别的都不多：基座权重和 KV 缓"
        "存的布局都是共享的。对 Llama-2-7B 每一层的全部七个线性层（q、k、v、o、gate、up、down）"
        "用 rank 16，是 40.0M 参数，fp16 下 80 MB，占基座模型线性层权重的 0.6%（不合并时每个 "
        "token 的 FLOPs 也多 0.6%）。只对 query 和 value 投影用 rank 8（LoRA 论文大多数实验就是适"
        "配这两个），是 4.2M 参数，8.4 MB。一百个 rank-16 适配器在一份 13.5 GB 的基座旁边占 8 GB"
        "，而一百个合并后的微调模型要 1.35 TB。没在用的适配器放在 CPU 内存里；通过 PCIe（~25 GB/s"
        "）加载一个只要几毫秒。常见错误回答：“每个微调模型都要单独一个副本”，这只有在把适配器合并"
        "进权重之后才成立。",
    ),
    "lora-batching": (
        "一个批里有请求用到同一个基座模型的五个不同 LoRA 适配器。一次前向怎么同时服务它们？为什么"
        "不把每个适配器合并进权重？",
        "基座权重保持不合并、大家共享：整个批的 x W^T 是一次大 GEMM，和没有 LoRA 时完全一样，然后"
        "每个 token 再加上自己的低秩项 (x A_i^T) B_i^T，适配器 i 由每个 token 的索引选出。Punica "
        "的 SGMV kernel（分段 gather 的矩阵-向量乘），以及从它演化来的 vLLM LoRA kernel，为每个 "
        "token 或每段 token 取出对应的 A 和 B，所以五个适配器的代价是一次基座 GEMM 加上很薄的 "
        "shrink（降到 rank r）和 expand（升回输出维度）两个乘法：对一个 4096 x 4096 的投影、rank "
        "16，FLOPs 只多 0.8%。把 W + B A 合并后每个 token 没有额外开销，但一份权重只能服务一个适"
        "配器（或者在步与步之间来回换权重），跨适配器组批就没了。S-LoRA 补上了显存这一面：所有适"
        "配器放在主机内存里，活跃的那些按页换入一个和 KV 缓存共用的 GPU 内存池（两者都由 hidden "
        "大小的向量组成），这样不同 rank 的适配器和不同长度的序列共用页面，不产生显存碎片。vLLM "
        "用 max_loras（一个批里的适配器数）、max_lora_rank 和 max_cpu_loras 暴露这些上限。不合并"
        "的代价是百分之几的延迟和多出来的 kernel 启动。常见错误回答：“每个适配器一个副本”。在 "
        "labkit 里：LLM(..., enable_lora=True, max_loras=4) 在一个批里混合多个适配器"
        "（lora/punica.py；Triton 版 SGMV/BGMV 在 kernels/lora_ops.py），labkit bench lora 测混合批"
        "与逐个适配器、与基座模型的吞吐对比。",
    ),
    "qlora-deploy": (
        "一个模型是用 QLoRA（NF4 基座加 16-bit 适配器）微调的。怎么部署？为什么“把适配器合并进原"
        "始的 fp16 权重”有一个隐蔽的错误？",
        "QLoRA 训练时，适配器只见过反量化后的 NF4 权重 W_q，所以你训练和评测的那个模型计算的是 x "
        "(W_q + s B A)^T。把 B A 合并进原始的 W，得到的模型和它差 x (W - W_q)^T，也就是整个 NF4 "
        "的舍入误差，而适配器可能已经部分学会了补偿这个误差：这和你评测过的不是同一个模型。可选的"
        "方案：(1) 在 NF4 基座上不合并直接服务（bitsandbytes kernel；vLLM 可以在 bitsandbytes "
        "4-bit 基座上加载 LoRA），和训练出来的模型完全一致，但 4-bit kernel 更慢；(2) 把 NF4 基座"
        "反量化成 fp16 再加上 B A，在舍入误差范围内等于训练出来的模型，用它来服务；(3) 再用 GPTQ "
        "或 AWQ 把合并后的模型量化一次以便高速推理，这会引入一份新的量化误差，所以要重新评测。推"
        "理引擎不能把 QLoRA 的产物当成量化 checkpoint 来加载：它是一个适配器加上一个训练时格式存"
        "储的基座，不是 GPTQ 或 AWQ checkpoint。常见错误回答：“QLoRA 已经产出了一个 4-bit 模型，"
        "直接当 4-bit 模型在 vLLM 里加载就行”。",
    ),
    "on-device": (
        "一部手机有 12 GB LPDDR5X（约 60 GB/s）和一个标称几十 TOPS 的 NPU。用 7B 模型和 1B 模型各"
        "能 decode 多快？选什么量化？",
        "decode 每个 token 要把每个权重读一遍，所以 tokens/s <= 内存带宽 / 每 token 读取的字节数"
        "；NPU 的 TOPS 加速的是 prefill（处理提示词，算力瓶颈），不是 decode。Llama-2-7B 的 fp16"
        "（13.5 GB）根本放不下。4-bit 加分组 scale 后是 3.9 GB，每 token 读约 3.6 GB（embedding "
        "查表只碰表里的一行），所以最多 ~16 tokens/s，实际 kernel 大概能达到其中的 60-80%。"
        "Llama-3.2-1B 在 fp16 下最多 ~24 tokens/s，线性层 4-bit 后 ~58，但它 128k 词表的 "
        "embedding 和 LM head 绑定（tied）且保持 fp16，这时就占了每 token 读取字节数的一半：输出"
        "矩阵也要量化（llama.cpp 的 Q4_K_M 把它存成 Q6_K）。这里 KV 缓存不大（每 token 32 KiB，"
        "4k token 时 128 MiB），但会随上下文增长，所以要限制上下文长度。选 4-bit 权重，显存和速度"
        "都受益（CPU/GPU 上用 GGUF k-quant，或者 NPU 工具链支持的 INT4/INT8 格式，激活用 INT8 或 "
        "FP16），整张计算图都留在 NPU 上（不支持的算子，比如融合注意力，会回退到 CPU，来回都要拷"
        "贝），用 mmap 映射权重让 App 秒开，并预期长时间会话会遇到发热降频。常见错误回答：“NPU "
        "有 40 TOPS，所以生成肯定很快”。",
    ),
    "safety-review": (
        "提示词和回复都要过一个安全分类器（比如 Llama Guard 这样的护栏模型），又不能让对话变慢。"
        "审核放在哪里？各自代价是多少？",
        "输入侧：护栏模型和主模型的 prefill 同时启动，只把第一个 token 扣住，等审核结果出来，这样"
        "首 token 延迟是 max(prefill, 审核) 而不是两者之和。A100 上一个 2,000 token 的提示词，"
        "Llama-2-7B 的 prefill 约 90 ms；1B 的护栏模型（Llama Guard 3 1B 基于 Llama-3.2-1B）约 "
        "17 ms，完全被掩盖；8B 的护栏模型约 107 ms，护栏本身就成了关键路径，所以护栏模型的大小是"
        "一个延迟决策。用级联控制成本：正则和黑名单微秒级，小分类器处理大部分流量，大护栏模型只看"
        "拿不准的情况，重复的系统提示词缓存审核结果。输出侧：文本还没生成就没法判断，所以按窗口审"
        "核（比如每 16 个 token 一次，对话的 KV 已经缓存，每次审核只是一次很短的 prefill）。要么"
        "每个窗口审核通过后再放出去，流式输出滞后 窗口 x TPOT + 审核时间（这里约 250 ms）；要么立"
        "即流式输出，发现违规再停止（并撤回），这会让少量不安全的 token 到达用户。护栏超时或宕机"
        "时由策略决定：fail closed（拒绝：安全优先）还是 fail open（放行：可用性优先）；按产品选"
        "择，两种都要告警。常见错误回答：“等完整回复审核完再发送”，这等于放弃了流式输出：用户要等"
        "完整的端到端延迟。",
    ),
}
