"""Compatibility: the named errors moved to :mod:`labkit.errors` (the bottom layer)."""

from labkit.errors import (
    EngineConfigError,
    EngineStepError,
    InvalidPromptError,
    SamplingParamsError,
    SpeculativeConfigError,
)

__all__ = ["EngineConfigError", "EngineStepError", "InvalidPromptError", "SamplingParamsError",
           "SpeculativeConfigError"]
