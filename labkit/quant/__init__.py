"""labkit.quant: weight formats (INT8, INT4 RTN, NF4/FP4, FP8), GPTQ, AWQ, INT8 KV cache,
checkpoints in the GPTQ / AutoAWQ layouts, and a memory calculator.

Start with ``quantize_model(model, "int4_rtn")``, then ``gptq_quantize_model`` /
``awq_quantize_model`` with calibration tokens, and compare with ``labkit bench quant``.
"""

from labkit.quant.awq import awq_quantize_model
from labkit.quant.bnb_backend import to_bnb_linear4bit
from labkit.quant.checkpoint import load_quantized, save_quantized
from labkit.quant.errors import CalibrationError, CheckpointMismatchError, QuantizationError
from labkit.quant.fp8 import quantize_fp8
from labkit.quant.gptq import gptq_quantize
from labkit.quant.kv_int8 import Int8ContiguousKVCache, quantize_kv_per_block, quantize_kv_per_head
from labkit.quant.linear import AWQLinear, FP8Linear, GPTQLinear, NF4Linear, W8A16Linear
from labkit.quant.memory import estimate_memory, kv_cache_bytes
from labkit.quant.model import gptq_quantize_model, quantize_model
from labkit.quant.nf4 import quantize_fp4, quantize_nf4
from labkit.quant.outliers import int8_outlier_matmul
from labkit.quant.rtn import quantize_int8, quantize_rtn

__all__ = [
    "AWQLinear", "CalibrationError", "CheckpointMismatchError", "FP8Linear", "GPTQLinear",
    "Int8ContiguousKVCache", "NF4Linear", "QuantizationError", "W8A16Linear",
    "awq_quantize_model", "estimate_memory", "gptq_quantize", "gptq_quantize_model",
    "int8_outlier_matmul", "kv_cache_bytes", "load_quantized", "quantize_fp4", "quantize_fp8",
    "quantize_int8", "quantize_kv_per_block", "quantize_kv_per_head", "quantize_model",
    "quantize_nf4", "quantize_rtn", "save_quantized", "to_bnb_linear4bit",
]
