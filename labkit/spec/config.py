"""``speculative_config``: its dataclass lives with every other engine setting in
:mod:`labkit.config` (checked once there; the draft is loaded and checked against the target
when the engine is built). Re-exported here, where speculative decoding's readers look."""

from labkit.config import SPEC_METHODS as METHODS
from labkit.config import SpeculativeConfig
from labkit.errors import SpeculativeConfigError

__all__ = ["METHODS", "SpeculativeConfig", "SpeculativeConfigError"]
