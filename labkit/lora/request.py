"""LoRARequest: which adapter a request runs with (vLLM's ``vllm.lora.request.LoRARequest``).

    LoRARequest("sql", 1, "/adapters/sql")   # name, integer id, a PEFT adapter folder

The integer id is the adapter's identity everywhere inside the engine: the adapter slots and the
CPU cache are keyed by it, and so is the prefix cache (two adapters never share KV blocks). As in
vLLM it must be >= 1 (0 would read as "no adapter"), and one id means one adapter: a request
that reuses an id with another path gets the adapter already loaded under that id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from labkit.errors import LoRAError
from labkit.utils import is_int


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str | Path

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise LoRAError(f"lora_name must be a non-empty str, got {self.lora_name!r}")
        if not is_int(self.lora_int_id) or self.lora_int_id < 1:
            raise LoRAError(f"lora_int_id must be an int >= 1 (vLLM's rule), got "
                            f"{self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, Path)):
            raise LoRAError(f"lora_path must be a folder path, got {self.lora_path!r}")
