"""Named errors for quantization, so a learner's mistake says what to fix.

All are ``ValueError`` subclasses: bad arguments, not bugs in labkit.
"""

from __future__ import annotations

SUPPORTED_BITS = (2, 4, 8)
SUPPORTED_GROUP_SIZES = (-1, 16, 32, 64, 128, 256)  # -1 = one group per output row


class QuantizationError(ValueError):
    """Arguments a quantizer cannot honour (bit width, group size, shapes)."""


class CalibrationError(QuantizationError):
    """A calibration set that is empty or too short to estimate activation statistics."""


class CheckpointMismatchError(QuantizationError):
    """A quantized checkpoint whose ``quantization_config`` disagrees with its tensors."""


def check_bits(bits: int, allowed: tuple[int, ...] = SUPPORTED_BITS) -> None:
    if bits not in allowed:
        raise QuantizationError(f"bits={bits!r} is not supported here; choose one of {allowed}")


def resolve_group_size(in_features: int, group_size: int, fallback: bool = False) -> int:
    """Validate ``group_size`` against the layer's input width; -1 becomes ``in_features``.

    ``fallback=True`` picks the largest supported size below ``group_size`` that divides
    ``in_features`` instead of raising (e.g. an FFN of 704 = 11 x 64 with g128 -> g64).
    """
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise QuantizationError(f"group_size={group_size!r} is not supported; choose one of "
                                f"{SUPPORTED_GROUP_SIZES} (-1 = per output channel)")
    if group_size == -1:
        return in_features
    if in_features % group_size and fallback:
        for gs in sorted(SUPPORTED_GROUP_SIZES, reverse=True):
            if 0 < gs < group_size and in_features % gs == 0:
                return gs
    if in_features % group_size:
        raise QuantizationError(f"in_features={in_features} is not divisible by group_size="
                                f"{group_size}; pick a group size that divides it")
    return group_size
