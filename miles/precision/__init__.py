"""Precision library: the one quantizer that the trainer and the rollout engine share.

- fp8.py          e4m3 blockwise quantize / dequantize (weights 128x128, activations 1x128, fp32 scales)
- fp8_gemm.py     fp8_linear with backends emulated / scaled_mm / deep_gemm / triton / auto
- fp8_triton_gemm.py  the batch-invariant Triton FP8 GEMM (a row's bits independent of the row count)
- invariance.py   the true on-policy flag the quantized GEMMs read (miles/models/invariant.py sets it)
- int4.py         W4A16 symmetric group quantization, nibble packing, int4_linear
- fake_quant.py   fake quantization with a straight-through estimator for the training forward (QAT)
- rollout_format.py  what weight sync carries per recipe, its inverse, checksums, layer exceptions
- qlora.py       a LoRA trainer's frozen base held in the rollout format (QLoRA under fp8 / int4_qat)

Pure tensor functions, bitwise identical on CPU and CUDA, no dependency on miles.models.
Tests: `pytest tests/unit/precision`; GPU figures: `python benchmarks/precision_gemm.py`.
"""

from miles.precision.fake_quant import (
    fake_fp8_linear,
    fake_int4_linear,
    fake_quant_fp8_act,
    fake_quant_fp8_weight,
    fake_quant_int4,
)
from miles.precision.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8_act,
    dequantize_fp8_weight,
    quantize_fp8_act,
    quantize_fp8_weight,
)
from miles.precision.fp8_gemm import (
    BACKENDS,
    PreparedFP8Weight,
    fp8_backend_report,
    fp8_linear,
    fp8_linear_prepared,
    prepare_scaled_mm_weight,
    quantize_act_for_scaled_mm,
    resolve_fp8_backend,
    scaled_mm_gemm,
)
from miles.precision.int4 import (
    INT4_MAX,
    dequantize_int4,
    int4_linear,
    pack_int4,
    quantize_int4,
    unpack_int4,
)
from miles.precision.rollout_format import (
    DEFAULT_KEEP_PATTERNS,
    RECIPES,
    from_rollout_format,
    high_precision_predicate,
    quantized_names,
    rollout_checksum,
    rollout_format,
)

__all__ = [
    "BACKENDS", "BLOCK", "DEFAULT_KEEP_PATTERNS", "FP8_DTYPE", "FP8_MAX", "INT4_MAX", "RECIPES",
    "PreparedFP8Weight", "dequantize_fp8_act", "dequantize_fp8_weight", "dequantize_int4", "fake_fp8_linear",
    "fake_int4_linear", "fake_quant_fp8_act", "fake_quant_fp8_weight", "fake_quant_int4", "fp8_backend_report",
    "fp8_linear", "fp8_linear_prepared", "from_rollout_format", "high_precision_predicate", "int4_linear", "pack_int4",
    "prepare_scaled_mm_weight", "quantize_act_for_scaled_mm", "quantize_fp8_act", "quantize_fp8_weight",
    "quantize_int4", "quantized_names",
    "resolve_fp8_backend", "rollout_checksum", "rollout_format", "scaled_mm_gemm", "unpack_int4",
]
