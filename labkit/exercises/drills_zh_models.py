"""Chinese drill text, part 2 (quantization, speculative decoding, latency metrics, MoE and the
frameworks). Data only: drill id -> (question, answer); see ``drills_zh_core``."""

from __future__ import annotations

ZH_MODELS: dict[str, tuple[str, str]] = {
    "quant-memory": (
        "Llama-2-7B 的权重在 fp16、INT8、INT4（GPTQ）和 NF4 下各占多少显存？",
        "fp16 大约 13.5 GB（6.7 B 参数 x 2 字节）。INT8 把线性层减半；4-bit 格式大约是四分之一，"
        "再加上每组一个 scale（和 zero point）；embedding 和 LM head 一般保持 fp16，所以 INT4 落"
        "在 3.9 GB 左右，一张消费级显卡就放得下。",
    ),
    "quant-decode-speed": (
        "为什么只量化权重（weight-only）能让 decode 变快，对 prefill 却几乎没用？",
        "小批量 decode 是访存瓶颈：每一步都要把全部权重读一遍，却只算几个 token，所以权重字节数"
        "少 4 倍，速度就接近快 4 倍。prefill 每读一次权重要处理成千上万个 token，是算力瓶颈；权重"
        "在做矩阵乘之前会先反量化回 fp16，浮点运算量一点没变。",
    ),
    "quant-per-channel": (
        "INT8 权重量化为什么按输出通道（per-channel）量化，而不是整个张量一个 scale？",
        "一个 scale 必须覆盖它管辖范围里最大的那个值。权重矩阵不同行的数值范围能差好几个数量级，"
        "整个张量共用一个 scale，小数值的行就白白浪费了 255 个量化级别里的大部分。每个输出通道一"
        "个 scale，每行只多存一个浮点数，误差却大幅下降；激活值里的离群值（outlier）要另想办法（"
        "LLM.int8 把离群特征留在 fp16 计算，SmoothQuant 把它们迁移到权重里）。",
    ),
    "quant-gptq-awq": (
        "RTN、GPTQ、AWQ 有什么区别？",
        "RTN（四舍五入到最近值）每组独立量化。GPTQ 逐列量化，每量化一列，就用校准数据上该层输入的"
        "逆 Hessian 更新还没量化的列，补偿这一列的舍入误差。AWQ 发现少数激活值很大的输入通道最重"
        "要，在舍入前把这些通道的权重放大（激活相应缩小），让它们损失更少的精度。在 4 bit 下两者"
        "都比 RTN 好；分组越小，每种方法都越准，代价是多存 scale。",
    ),
    "quant-nf4": (
        "NF4 是什么？QLoRA 为什么用它？",
        "NormalFloat-4 把 16 个量化级别放在正态分布的分位点上，服从正态分布的权重会比较均匀地用到"
        "每个级别：同样的位数，误差比均匀的 4-bit 网格更低。每 64 个权重一个块，共享一个 absmax "
        "scale；双重量化（double quantization）再把这些 scale 用 8 bit 存。bitsandbytes 实现了它"
        "；QLoRA 在冻结的 NF4 基座模型上训练 LoRA 适配器。",
    ),
    "quant-tools": (
        "不同的部署场景各用什么量化工具？",
        "bitsandbytes（NF4/INT8）适合在 Transformers 里快速加载和做 QLoRA 微调；GPTQ（GPTQModel，"
        "AutoGPTQ 仍在维护的继任者）和 AWQ（AutoAWQ 已停止维护，AWQ 由 vLLM 的 llm-compressor 接"
        "手）产出 4-bit checkpoint，用 vLLM 或 SGLang 高速推理（TGI 也能跑，但它从 2025 年十二月起"
        "已进入维护模式）；llama.cpp 的 GGUF k-quant 面向 CPU、Apple 芯片和边缘设备；在有 FP8 "
        "tensor core 的 GPU 上用 TensorRT-LLM 或 vLLM 跑 FP8：Ada（L4、L40S）、Hopper（H100、"
        "H200）和 Blackwell（B200、GB200、B300）。FP4 格式（NVFP4、MXFP4）只有 Blackwell 的 tensor "
        "core 能直接算；Hopper 有 FP8、没有 FP4 tensor core，FP4 checkpoint 在它上面要先反量化再"
        "做矩阵乘（只量化权重：省显存，但没有 FP4 算力）。上线前用困惑度（perplexity）加上任务基准"
        "评测精度损失。",
    ),
    "spec-speedup": (
        "投机解码：目标模型每一步能产出多少 token？加速比是多少？",
        "每个 token 的接受率为 a、草稿 token 数为 g 时，目标模型一步平均产出 (1 - a^(g+1)) / (1 "
        "- a) 个 token（被接受的草稿加上目标模型自己的一个 token）。如果草稿模型一步的开销是目标"
        "模型一步的 c 倍，加速比就是上面的值除以 (g*c + 1)。a = 0.8、g = 4、c = 0.05 时，每步 "
        "3.4 个 token，加速约 2.8 倍。",
    ),
    "spec-exact": (
        "为什么投机采样的输出分布和目标模型完全一致？",
        "以 min(1, p(x)/q(x)) 的概率接受草稿 token x；被拒绝时从 normalize(max(0, p - q)) 里重新"
        "采样。输出 y 的概率是接受带来的 min(p, q)(y) 加上残差分布带来的 max(0, p - q)(y)，两者相"
        "加正好是 p(y)。草稿模型差只会降低接受率，不会降低质量。",
    ),
    "spec-hurts": (
        "什么情况下投机解码不划算？",
        "接受率低的时候（草稿模型弱、温度高、文本和草稿模型的训练数据差别大），草稿模型并不比目标"
        "模型便宜多少的时候，以及批很大、目标模型已经是算力瓶颈，验证 g 个额外 token 不再是免费的"
        "时候。这时草稿的开销占了主导，加速比会掉到 1 以下。",
    ),
    "metrics-defs": (
        "给出 TTFT、TPOT、ITL 和 E2E 延迟的定义。聊天用户最先感受到的是哪一个？",
        "TTFT（首 token 延迟）= 首 token 时间 - 到达时间：排队加 prefill，是聊天用户最先感受到的"
        "。TPOT（每个输出 token 的时间）= (最后一个 token 时间 - 首 token 时间) / (n - 1)：也就"
        "是 decode 速度，应该比人的阅读速度快。ITL 是相邻 token 之间的每一个间隔（它的长尾暴露卡"
        "顿）。E2E = 完成时间 - 到达时间 = TTFT + (n - 1) x TPOT。SLO 按每个指标的 P50 和 P99 来"
        "定。",
    ),
    "metrics-roofline": (
        "Llama-2-7B 在 batch 1 下，A100 和 H100 分别能做到多少 TPOT？为什么？",
        "batch 1 的 decode 每个 token 都要读完 13.5 GB 的权重，所以 TPOT 约等于权重字节数 / 显存"
        "带宽：A100（2 TB/s）上 ~7 ms，H100（3.35 TB/s）上 ~4 ms。这里 FLOP/s 几乎不起作用，起作"
        "用的是带宽。",
    ),
    "metrics-tradeoff": (
        "吞吐和延迟怎么权衡：批开大一点要付出什么？",
        "只要读权重还是主要开销，decode 批越大，tokens/s 几乎线性增长，而每一步的耗时（每个用户看"
        "到的 TPOT）只是缓慢增加，直到读 KV 和算力接管。运维会选 P99 TPOT 仍满足 SLO 的最大批；同"
        "一步里的长 prefill 会拉高 TPOT，分块 prefill 可以把它限住。",
    ),
    "moe": (
        "Mixtral-8x7B 有 47B 参数，为什么跑起来像一个 13B 模型？代价是什么？",
        "每个 MoE 层有 8 个专家 MLP 和一个路由器，每个 token 被路由到 top 2 个专家，所以一个 "
        "token 只经过注意力层和 8 个专家里的 2 个：每 token 激活的参数约 13B。但 47B 参数必须全部"
        "放在显存里，而且批大时每个专家都会分到 token，所以显存和带宽的压力和 47B 模型一样。用专"
        "家并行（expert parallelism）时，token 要发到专家所在的 GPU 再发回来：每个 MoE 层两次 "
        "all-to-all 通信，跨节点时这是主要开销。在 labkit 里：MoE 检查点用 LLM(..., "
        "tensor_parallel_size=2, enable_expert_parallel=True) 运行，trace 会统计这些字节（层数 x "
        "token 数 x top-k x hidden x 字节数，每个方向）；labkit bench moe 把它和逐专家循环、融合 "
        "kernel 放在一起测。",
    ),
    "moe-ep-comm": (
        "DeepSeek-V3（671B，256 个专家，top-8）用专家并行：一个 8 卡 H200 节点放得下吗？"
        "加第二个节点，全对全通信要多付出什么？",
        "FP8 下权重约 625 GiB。专家分散到 8 张 GPU、注意力层复制（数据并行，因为 MLA "
        "的缓存无法按头切分）时，每张 GPU 约占 92 GiB（共 141 GiB）：放得下（bf16 则每张 "
        "GPU 需要 184 GiB）。每个 MoE 层把 token 数 x 8 x 7168 x 2 字节分发（dispatch）"
        "给专家，再合并（combine）回同样多。单节点时每张 GPU 的行有 7/8 走 NVLink（每个"
        "方向 450 GB/s）；两个节点时其中一半要经这张 GPU 自己的 50 GB/s 网卡离开节点，所以"
        "同一步的全对全通信（all-to-all）慢约 2.6x，尽管每张 GPU 收到的行只有一半。路由倾斜"
        "会更糟，因为最忙的 GPU 决定整步的速度；EPLB 按负载重新放置专家，并把最热的专家复制"
        "到空闲槽位，把 max/mean 降到接近 1（负载均衡），代价是这些副本占的显存。在 labkit "
        "里：labkit.sim.expert（ep_table、ep_plan、eplb）。",
    ),
    "gguf": (
        "GGUF 是什么？Q4_0 存的是什么？",
        "GGUF 是 llama.cpp 的单文件格式：元数据（架构、分词器、超参数）加上张量，排布方式让文件可"
        "以直接 mmap 使用，不用拷贝。Q4_0 把每 32 个权重分成一块，存 4-bit 码加一个 fp16 scale："
        "每个权重 4.5 bit，对称量化。K-quant（Q4_K_M 等）加了超级块（super-block）和量化过的 "
        "scale，并按张量混合精度，体积相近时质量更好。",
    ),
    "llama-cpp-offload": (
        "llama.cpp 在一台只有 8 GB 显卡的笔记本上，怎么跑一个显存放不下的模型？",
        "模型能放进 GPU 的部分放在 GPU 上，其余的在 CPU 上跑，这部分权重直接从 mmap 的 GGUF 文件"
        "里读。新版 llama.cpp 会自己决定怎么分：--fit（默认打开）把你没设置的参数，GPU 层数（-ngl "
        "auto）和上下文长度，调到刚好放进空闲显存；-ngl N 或 -ngl all 仍然可以手动指定层数。放置"
        "还可以按张量、而不只是按层来做：-ot / --override-tensor 把名字匹配某个模式的张量放到指定"
        "的 buffer（比如把某些层的 FFN 权重放到 CPU），MoE 模型还可以用 --n-cpu-moe N（或 "
        "--cpu-moe）把前 N 层（或全部层）的专家权重留在内存里。这是小显卡跑大 MoE 的常见分法：专"
        "家占了大部分字节，但每个 token 只读被路由到的那几个；注意力和共享权重每个 token 都要读，"
        "留在 GPU 上。每个 token 两边都要走一遍，所以速度介于纯 CPU 和纯 GPU 之间；量化决定了能放"
        "多少进 GPU。",
    ),
    "trtllm": (
        "TensorRT-LLM 能给你带来什么？它的引擎编译后来怎么样了？",
        "它一开始是个编译器：针对一种 GPU 架构和一段 shape 范围构建 TensorRT 引擎，里面是融合 "
        "kernel（QKV 投影、注意力、带残差的 norm、激活和矩阵乘融合），减少显存往返和 kernel 启动"
        "开销，还有 kernel 自动调优。代价是构建时间长，引擎和 GPU 型号、版本绑死。到 1.x 版本，它"
        "的默认后端是 PyTorch（不用构建引擎，直接加载 Hugging Face checkpoint），最新版本干脆移除"
        "了 TensorRT 引擎后端；现在选它，看中的还是那套 NVIDIA 手工调优的 kernel（注意力，tensor "
        "core 上的 FP8/FP4/INT4 GEMM，FP4 只在 Blackwell 上）、"
        "in-flight（连续）批处理，以及分页、可复用的 KV 缓存。",
    ),
    "cuda-graphs": (
        "为什么推理引擎要按批大小捕获 CUDA Graph？为什么 vLLM 能把纯 decode 批整图捕获，带 "
        "prefill 分块的批却只能分段（piecewise）捕获？",
        "小批量 decode 一步要发射几百个小 kernel，每次发射都要花主机几微秒，所以这一步是在等 "
        "Python 和驱动，而不是等 GPU。CUDA Graph 把这些发射录一次、之后一次调用整体重放，但它把"
        "每个张量的形状和显存地址都固定住了：所以引擎按补齐后的批大小各捕获一张图（vLLM 的 "
        "cudagraph_capture_sizes：1、2、4、8……512），每一步补齐到下一个大小。随步骤变化的是注意力："
        "纯 decode 批里每条序列只带一个 query，kernel 从固定的缓冲区读块表和上下文长度，所以连注"
        "意力在内整步就是一张图。混有任意长度 prefill 分块的批只能分段捕获：注意力之间的部分各成"
        "一张图，注意力在图之间 eager 执行。vLLM 默认的 cudagraph_mode FULL_AND_PIECEWISE 两者都"
        "用。代价是启动时的捕获时间和每个大小的缓冲区显存；超过最大捕获大小的批走 eager。labkit "
        "的 compile=True 在 CPU 上用 inductor 做同样的事（notebook 15 §4.2b 两者都测；labkit "
        "bench step 测得 batch 1 时 fused + compiled 是 fused + piecewise 的 1.8 倍）。",
    ),
    "attention-op": (
        "编译后的 decode 步里，为什么推理引擎把手写的注意力 kernel 当作一个不透明的算子调用，"
        "而不让编译器生成注意力？什么时候跳出图去调用它反而不划算？",
        "编译器擅长融合逐元素运算链、调用 GEMM 库，但分页 KV 缓存上的 decode 注意力是一次经块表"
        "的 gather 加上一次 softmax 归约；让它快的循环结构（每行 K、V 只读一次，供共享它的所有 "
        "query 头使用；只读每条序列自己的 key；沿 key 方向做 softmax）并不是通用融合能产生的。"
        "vLLM 把注意力注册成自定义算子（unified_attention，另配一个供追踪用的 fake 实现），"
        "torch.compile 只看到一个节点：分段图在这里切开，整图 CUDA Graph 则把 kernel 捕获在图内。"
        "这个算子是不透明的：跨它无法融合，调用本身也有开销，所以步子很小时生成的代码可能更快，"
        "引擎会按批的形状挑 kernel。labkit 在 CPU 上把两者都测了：batch 32 时 inductor 为 "
        "labkit-tiny 生成的注意力循环每层约是 C++ 算子的 4 倍耗时；而 batch 1 和 8 时，调用这个"
        "算子（每层约 60 微秒）让每步慢 0.35 毫秒，所以 labkit 的整图只在序列数 × 桶内 key 数达到 "
        "2048 时才调用它。",
    ),
    "frameworks": (
        "为什么 vLLM 比直接用 Hugging Face Transformers 的 generate 快？什么时候该选别的框架？",
        "Transformers 的 generate 把请求补齐（padding）成一个静态批，一直跑到最长的序列结束；它默"
        "认的 DynamicCache 每一步都用拼接（concatenation）把每层的 K、V 张量加长（StaticCache 则"
        "为每条序列预分配 max_cache_len 个 token 的空间，配合 torch.compile 用）。vLLM 对 KV 缓存"
        "做分页（能放更多序列）、连续批处理（没有空槽）、共享前缀，还用融合 kernel，所以高负载下"
        "吞吐能高好几倍。新版 Transformers 加了 generate_batch，一条带分页缓存的连续批处理路径；"
        "但从头到尾围绕这些思想构建的引擎仍然是 vLLM。要榨干 NVIDIA 硬件的最后一点性能选 "
        "TensorRT-LLM，前缀复用多、有结构化生成程序选 SGLang（RadixAttention），CPU、笔记本和边缘"
        "设备选 llama.cpp 或 Ollama。",
    ),
    "compression": (
        "量化、蒸馏和剪枝有什么区别？通常怎么组合使用？",
        "量化不改模型，只是用更少的位来存。蒸馏训练一个更小的学生模型去拟合老师模型的输出分布（软"
        "标签），模型结构变了。剪枝是删权重：非结构化稀疏要有稀疏 kernel 才有收益，结构化剪枝（剪"
        "注意力头、通道、层）在普通硬件上就能提速。常见流程是先蒸馏、再剪枝、最后量化；在大模型推"
        "理服务里，用得最多的还是量化。",
    ),
}
