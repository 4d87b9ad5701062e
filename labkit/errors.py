"""labkit's named errors (the bottom layer: every package may raise them, none is imported here).

Each says what was wrong and what to change.

Bad input is caught where it enters (``SamplingParams``, ``LLMEngine.add_request``, the engine's
constructor), so it never reaches ``step()``: a bad value found mid-batch would fail every
request sharing that step, or worse, come back as a silently wrong answer. All of them subclass
``ValueError``, so ``except ValueError`` keeps working.

``EngineStepError`` is different: something failed *inside* a step (a model forward, a kernel,
a tokenizer). The engine then fails the requests that step touched, frees all their blocks, and
raises it with their ids; every other request is untouched and the engine keeps working.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config.json labkit cannot build a model from; the message names the field (raised by
    :mod:`labkit.model.config` and the modules it reads config.json with)."""


class SamplingParamsError(ValueError):
    """A SamplingParams field has the wrong type or range."""


class StructuredOutputsError(SamplingParamsError):
    """A structured-output constraint cannot be used: an invalid JSON schema, regex or grammar,
    xgrammar not installed, or an engine that cannot mask logits (speculative decoding)."""


class InvalidPromptError(ValueError):
    """A prompt (or a request's other arguments) cannot be served: empty, wrong types, token ids
    outside the vocabulary, too long for the context or the KV pool, a duplicate id."""


class EngineConfigError(ValueError):
    """An engine setting is out of range or unknown (block size, pool sizes, policy...)."""


class AsyncSchedulingError(EngineConfigError):
    """async_scheduling=True asked together with a feature it cannot run beside (speculative
    decoding, LoRA, tensor parallelism, a KV connector) or on an executor without a forward to
    overlap (the simulator)."""


class SpeculativeConfigError(EngineConfigError):
    """The speculative_config cannot work with this target model (a kind of engine setting)."""


class LoRAError(ValueError):
    """A LoRA adapter cannot be served: a folder that is not a PEFT LoRA adapter, a rank above
    ``max_lora_rank``, a target module the model lacks, shapes that do not match the base model,
    or a request carrying an adapter to an engine built without ``enable_lora=True``."""


class EngineStepError(RuntimeError):
    """A step failed; the requests it touched were failed (finish reason ``"abort"``) and freed.

    ``request_ids`` lists them; ``__cause__`` is the original exception."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class MoEUnsupportedError(ValueError):
    """A feature that does not handle mixture-of-experts layers yet was asked to run on an MoE
    model (tensor parallelism, weight quantization, GGUF export, pruning...). Raised instead of
    quietly treating the experts as something they are not; the message names the feature and
    the architecture."""

    def __init__(self, feature: str, architecture: str, moe_layers: list[int]) -> None:
        super().__init__(
            f"{feature} does not support mixture-of-experts models yet: this {architecture} has "
            f"sparse MoE MLPs in layers {moe_layers}. Use a dense model for {feature}, or run "
            "the MoE model without it.")
        self.feature = feature
        self.architecture = architecture


class ArchitectureUnsupportedError(ValueError):
    """A feature written for Llama's decoder layer was asked to run on an architecture whose
    layer differs in ways it would silently get wrong (gpt-oss's sinks, Gemma 3's sandwich
    norms); the message names the feature, the architecture and what differs."""

    def __init__(self, feature: str, architecture: str, why: str) -> None:
        super().__init__(f"{feature} does not support {architecture} yet ({why}). Run the "
                         f"model without {feature}.")
        self.feature = feature
        self.architecture = architecture


class MLAUnsupportedError(ValueError):
    """A feature that addresses attention weights by the dense names (``q_proj``, ``k_proj``,
    ``v_proj``) or caches per-head K/V was asked to run on a latent-attention model (MLA,
    DeepSeek-V3: ``q_a_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj`` and a latent cache). Raised
    instead of quantizing, sharding or exporting the wrong tensors."""

    def __init__(self, feature: str, architecture: str) -> None:
        super().__init__(
            f"{feature} does not support latent attention (MLA) yet: this {architecture} "
            f"projects K and V through a shared latent, not q_proj/k_proj/v_proj. Run the MLA "
            f"model without {feature}.")
        self.feature = feature
        self.architecture = architecture


class KVConnectorError(RuntimeError):
    """A KV connector broke its contract with the scheduler (matched a partial block or more
    tokens than the prompt may skip, loaded into blocks that were not allocated for it): a bug
    in the connector, caught before any KV is read from the wrong place."""


class WeightUpdateError(ValueError):
    """A hot weight update cannot be applied: a tensor missing, unexpected or of another shape
    than the running model's, a version string already used, or an executor that cannot swap
    weights in place (tensor-parallel workers, LoRA, speculative decoding, the simulator).
    Raised before any weight is touched, so the old weights keep serving."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded; the message says what is missing or wrong."""
