"""Chinese drill text, part 4 (tensor and pipeline parallelism, weight loading, hot updates).
Data only: drill id -> (question, answer); see ``drills_zh_core``."""

from __future__ import annotations

ZH_SCALE: dict[str, tuple[str, str]] = {
    "tp-split": (
        "Llama-2-70B 在 8 张 H100-80GB 上用 Megatron 式的张量并行跑。每张卡上放的是什么？一层的前"
        "向要做几次 all-reduce？和 TP=4 相比能多放多少 KV 缓存？",
        "张量并行切的是每一层里的矩阵，不是把层分给不同的卡。注意力按头切：q/k/v_proj 按列并行（"
        "每张卡算自己那几个查询头和 KV 头），o_proj 按行并行；MLP 里 gate/up_proj 按列并行（每张"
        "卡拿中间维度的一段），down_proj 按行并行。按行并行的矩阵乘让每张卡都只有完整 [tokens, "
        "hidden] 输出的一个部分和，所以每层前向要两次 all-reduce，注意力之后一次、MLP 之后一次（"
        "按词表并行的 embedding 和 LM head 每一步再加一次 all-reduce 和一次 gather）。每张卡的权"
        "重：138 GB / 8 = 17.2 GB。KV 缓存跟着头一起切：每张卡存 8 个 KV 头中的 1 个，每 token "
        "40 KiB，而不是 320 KiB。按 80 GiB 的 90% 算，大约还能放 1.47M 个 token（每张卡都存着每"
        "个 token 的一片，所以这就是整组的容量），TP=4 时只有 0.52M：是 2.8 倍而不是 2 倍，因为每"
        "张卡上的权重也变少了。TP 超过 num_kv_heads 之后，一张卡不可能只存半个头，KV 头只能复制："
        "TP=16 让每张卡的权重再减半，但每张卡每个 token 存的 KV 不变。常见错误回答：“每张卡分到几"
        "层”（那是流水线并行），或者“每张卡上都复制一份 KV 缓存”。",
    ),
    "tp-vs-pp": (
        "Llama-2-70B 跑在 8 张卡上，用张量并行还是流水线并行：每生成一个 token 各自要传多少字节？"
        "batch-1 的延迟会怎样？节点内用哪个，跨节点用哪个？",
        "TP 每层要对 [tokens, hidden] 的激活做两次 all-reduce。环形 all-reduce（ring all-reduce）"
        "让每张卡发送（和接收）2 x (TP-1)/TP 倍的消息量，所以每个 token 每一层，每张卡发送 2 x 2 "
        "x (TP-1)/TP x hidden x 字节数 = 57,344 字节（TP=8，hidden 8192，bf16），80 层下来是 4.6 "
        "MB。PP 给每个 stage 一段连续的层，只在 stage 边界点对点地把每个 token 的激活传过去：一"
        "个 bf16 的 hidden 向量，每 token 16 KiB（引擎同时传残差时是 32 KiB，vLLM 就是这样），流"
        "量少一百多倍。延迟：TP 时八张卡同时算每一层，每张卡只读 1/8 的权重，所以在 H100 上 "
        "batch-1 一个 token 大约 5 ms，再加上 160 次小 all-reduce，batch 1 时伤人的是它们的固定延"
        "迟，而不是带宽。PP 时各个 stage 依次执行，一个 token 仍然要等全部 138 GB 读完（大约 41 "
        "ms，不比一张足够大的卡快）；PP 只有在多个 micro-batch 同时在流水线里时才能提高吞吐，"
        "micro-batch 太少就会有气泡（bubble）。带宽决定了各自放在哪：TP=8 下一次 2,048 token 的 "
        "prefill 每张卡要传 9.4 GB，走 NVLink（单向 450 GB/s）约 21 ms，而计算要 36 ms；走一条 "
        "400 Gb/s 的 InfiniBand 链路却要约 190 ms。所以 TP 放在 NVLink 节点内，PP 跨节点（vLLM："
        "tensor_parallel_size = 每个节点的 GPU 数，pipeline_parallel_size = 节点数）。常见错误回"
        "答：“流水线并行能让单个请求更快”。",
    ),
    "safetensors-mmap": (
        ".safetensors 文件里面是什么？服务加载模型时，用 mmap 映射它到底省了什么？",
        "一个 8 字节小端序的头长度，一个 JSON 头，把每个张量名映射到它的 dtype、shape 和 [begin, "
        "end) 字节偏移，然后是首尾相接的原始张量字节。里面没有 pickle，所以加载时不会执行代码（"
        "torch.load 读 .bin 文件要反序列化 pickle；只有它的 weights_only 模式，从 PyTorch 2.6 起"
        "是默认值，才会限制能构造出什么），而且可以只读任意一个张量，或者它的某几行（"
        "safe_open(...).get_slice），不碰其余部分，所以每个张量并行的 rank 只读每个矩阵里属于自己"
        "的那一片。加载器用 mmap 映射文件：打开是瞬间完成的，因为在访问某一页之前什么都不读；页来"
        "自操作系统的页缓存（page cache，映射同一文件的所有进程共享，重启之后仍然是热的），也不用"
        "再拷贝一份到私有缓冲区。但这些字节不是白来的：第一次前向，或者拷到 GPU 上时，仍然要把每"
        "个字节从磁盘读上来：冷启动时，Llama-2-7B 的 13.5 GB 从 1 GB/s 的网络盘读大约 13 s，从 7 "
        "GB/s 的本地 NVMe 盘读大约 2 s，而零散的 4 KiB 缺页中断可能比一次顺序读还慢；页缓存是热的"
        "时候，下限是主机到 GPU 的拷贝，走 PCIe 4.0 x16（~25 GB/s）大约 0.5 s。收益最大的是 CPU "
        "上的 llama.cpp，因为它直接在映射的页上计算。常见错误回答：“mmap 几毫秒就能加载一个 14 "
        "GB 的模型”：瞬间完成的只是映射。",
    ),
    "cold-start": (
        "Llama-2-70B 的权重放在对象存储（S3）里。一台新的 8 卡节点要尽快开始服务（冷启动）。时间"
        "都花在哪了？怎么优化？",
        "bf16 的 checkpoint 有 138 GB。单个 GET 流（每个连接 100 MB/s 量级）要超过 20 分钟。对 "
        "checkpoint 的各个分片并行发很多个分段 GET（每段 8-16 MB），瓶颈就变成节点的网卡：100 "
        "Gb/s（12.5 GB/s）下大约 11 s，前提是存储跟得上。节点本地的 NVMe 缓存每块盘 ~7 GB/s，大"
        "约 20 s；重启时如果文件还在页缓存里，只需要付主机到 GPU 的拷贝，每张卡并行加载自己那 17 "
        "GB 的分片（25 GB/s 下大约 0.7 s）。两个坑：如果每个张量并行 rank 都读整个 checkpoint，节"
        "点要搬 8 x 138 GB = 1.1 TB（12.5 GB/s 下大约 88 s），所以每个 rank 只应该读自己的分片；"
        "另外先下载再加载是两个阶段串行，而分片一到就流式送上 GPU 能让两者重叠。实践中：分片的 "
        "safetensors 并行拉取，按 rank 切片加载，提前填好节点本地缓存（用 DaemonSet，或者在 "
        "bucket 前面加一层带缓存的文件系统），再加上热备副本，因为任何加载器都比不过一个已经加载"
        "好的副本。常见错误回答：“把 bucket 挂载上来直接 mmap”：没有本地缓存，每次缺页中断都是一"
        "次网络往返。",
    ),
    "hot-update": (
        "怎么在不丢掉进行中请求的前提下，把新版本模型滚动上线到推理集群？KV 缓存和前缀缓存会怎样"
        "？",
        "先把一个副本摘流（readiness 检查失败，网关不再往它路由），等它正在跑的请求跑完（drain，"
        "排空），再停掉它、启动新版本，新版本要等权重加载完、预热请求通过之后才接流量；逐个副本重"
        "复，并多备一个副本（surge），保证容量不下降。蓝绿发布则是两个版本都完整部署，再切换路由"
        "：回滚瞬间完成，但切换期间要两倍的 GPU；进程内替换（Triton Inference Server）需要能同时"
        "放下两套权重的显存。排空时间必须比最长的一次生成还长：4,096 个 token、每步 decode 24 ms"
        "（Llama-2-7B，batch 64，A100）大约 100 s，而 Kubernetes 默认在 SIGTERM 之后 30 s 就杀掉 "
        "pod，所以要调大 terminationGracePeriodSeconds，并在 preStop 钩子里停止准入，否则最长的那"
        "些流会被截断。一个请求必须在它开始时的版本上跑完：它的 KV 缓存是旧权重算出来的，用新权重"
        "在旧 KV 上 decode，得到的既不是旧模型也不是新模型。新启动的引擎进程前缀缓存是空的，但原"
        "地更新权重（RL 训练循环就是这样做的）或者多个实例共享 KV 缓存时，陷阱依然存在：块的键哈"
        "希的是 token id，而不是权重，所以要清空缓存（vLLM 的 reset_prefix_cache），或者像缓存盐"
        "值一样把模型版本放进键里。无论哪种，新缓存填满之前，首 token 延迟（TTFT）都会上升。如果"
        "只换一个 LoRA 适配器，用新名字加载新适配器再切路由即可，基座模型一直留在显存里。常见错误"
        "回答：“Kubernetes 的滚动更新开箱即零停机”。",
    ),
}
