"""SimExecutor: the real scheduler and block manager, no tensors, a roofline clock.

Each step the engine hands it the same SchedulerOutput the model executor gets. Instead of a
forward pass it (1) asks ``labkit.sim.cost.step_time`` how long that batch would take on the
chosen GPU for the chosen model and advances the engine's virtual clock by it, and (2) emits one
placeholder token for every sequence whose chunk reached its end. Each simulated request carries
``max_tokens = output_len`` and ignores EOS, so it finishes after exactly its predetermined
output length. Everything else (admission, chunking, preemption, prefix hits, the trace, the
timestamps and metrics) is the engine's own code, which is the point of the simulator.

Block operations cost time too (``apply_block_ops``): swapping a block out or in moves its KV
bytes over the host link (``GPUPreset.host_bandwidth``, PCIe), a copy-on-write copies it within
HBM (read + write). They are charged before the step's forward, serially, as vLLM's V0 engine
issued its cache operations; without this a simulated swap would be free and always beat
recomputation.
"""

from __future__ import annotations

from labkit.engine.clock import VirtualClock
from labkit.engine.executor import Executor, ModelRunnerOutput
from labkit.kv.block_manager import BlockOps
from labkit.sched.scheduler import SchedulerOutput
from labkit.sim.cost import step_time
from labkit.sim.presets import GPUPreset, ModelPreset, get_gpu, get_model_preset


class SimExecutor(Executor):
    name = "sim"
    real_tokens = False  # placeholder ids: the trace keeps no prompt tokens

    def __init__(self, model: ModelPreset | str, gpu: GPUPreset | str,
                 clock: VirtualClock, vocab_size: int = 32000, block_size: int = 16) -> None:
        self.model = get_model_preset(model)
        self.gpu = get_gpu(gpu)
        self.clock = clock
        self.vocab_size = vocab_size
        self.block_bytes = block_size * self.model.kv_bytes_per_token
        self.busy_s = 0.0
        self.block_ops_s = 0.0  # of busy_s: swaps and copy-on-write copies

    def apply_block_ops(self, ops: BlockOps) -> None:
        """Charge the step's block copies and swaps (see the module doc) to the clock."""
        dt = ((len(ops.swap_out) + len(ops.swap_in)) * self.block_bytes / self.gpu.host_bandwidth
              + len(ops.copies) * 2 * self.block_bytes / self.gpu.mem_bandwidth)
        if dt:
            self.block_ops_s += dt
            self.busy_s += dt
            self.clock.advance(dt)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        prefill = decode = context = pairs = 0
        results: dict[str, list[int]] = {}
        V = self.vocab_size
        for sc in scheduler_output.scheduled:
            n, start = sc.num_new_tokens, sc.start_pos
            if sc.is_prefill:
                prefill += n
            else:
                decode += n
            context += start
            pairs += n * start + n * (n + 1) // 2
            if sc.samples:
                seq = sc.seq
                # placeholder ids, distinct per sequence and position (no accidental prefix hits)
                results[seq.seq_id] = [(seq.num_tokens * 2654435761 + seq.request.index) % V]
                for c in sc.children:
                    results[c.seq_id] = [(c.num_tokens * 2654435761 + c.index * 7919
                                          + c.request.index) % V]
        dt = step_time(self.model, self.gpu, prefill, decode, context, attention_pairs=pairs)
        self.busy_s += dt
        self.clock.advance(dt)
        return ModelRunnerOutput(results)
