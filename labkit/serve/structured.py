"""Structured-output fields of a request body, turned into the engine's StructuredOutputsParams.

Three spellings reach the same constraint, as vLLM accepts them:

- OpenAI's ``response_format``: ``{"type": "text"}`` (nothing), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- vLLM's ``structured_outputs`` object (v0.10+): ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": ..., "disable_any_whitespace": bool}``;
- vLLM's older top-level extras (removed upstream in v0.12, still sent by many clients):
  ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``,
  ``guided_decoding_backend`` ("xgrammar" or "auto": labkit has only xgrammar).

Only one of them per request: two constraints cannot both hold, so that is a 400, as are an
unknown ``response_format`` type, a malformed field and a missing xgrammar. An invalid schema or
regex is found when the engine compiles it (``add_request``): :func:`add_error` names the field.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from labkit.engine.sampling_params import StructuredOutputsParams
from labkit.engine.structured_output import INSTALL_HINT
from labkit.errors import StructuredOutputsError
from labkit.serve.logprobs import FieldError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
FIELDS = ("response_format", "structured_outputs", *GUIDED)
SO_KEYS = frozenset({"json", "regex", "choice", "grammar", "json_object",
                     "disable_any_whitespace"})
BACKENDS = (None, "auto", "xgrammar")


def _response_format(rf: Any) -> dict[str, Any] | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise FieldError("response_format must be an object with a type", "response_format")
    t = rf["type"]
    if t == "text":
        return None
    if t == "json_object":
        return {"json_object": True}
    if t == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema", js.get("json_schema")) if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise FieldError("response_format.json_schema.schema must be a JSON schema object",
                             "response_format.json_schema")
        return {"json": schema}
    raise FieldError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                     f"got {t!r}", "response_format.type")


def _structured_outputs(so: Any) -> dict[str, Any]:
    if not isinstance(so, dict):
        raise FieldError("structured_outputs must be an object", "structured_outputs")
    unknown = sorted(set(so) - SO_KEYS)
    if unknown:
        raise FieldError(f"structured_outputs fields {unknown} are not supported by labkit's "
                         f"server (supported: {sorted(SO_KEYS)})", "structured_outputs",
                         "unsupported")
    return {k: v for k, v in so.items() if v is not None}


def parse_structured(d: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's constraint and the field it came from (None, None when there is none).
    Raises FieldError (message, param, code) for protocol's 400."""
    backend = d.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise FieldError(f"guided_decoding_backend must be 'xgrammar' or 'auto' (labkit has "
                         f"only xgrammar), got {backend!r}", "guided_decoding_backend",
                         "unsupported")
    given = [f for f in FIELDS if d.get(f) is not None]
    if not given:
        return None, None
    if len(given) > 1:
        raise FieldError(f"give one structured-output field, got {given}", given[1])
    name = given[0]
    if name == "response_format":
        kw = _response_format(d[name])
    elif name == "structured_outputs":
        kw = _structured_outputs(d[name])
    else:
        kw = {GUIDED[name]: d[name]}
    if kw is None:
        return None, None
    if importlib.util.find_spec("xgrammar") is None:
        raise FieldError(f"{name}: {INSTALL_HINT} on the server", name, "unsupported")
    try:
        return StructuredOutputsParams(**kw), name
    except StructuredOutputsError as e:
        raise FieldError(f"{name}: {e}", name) from None


def add_error(e: ValueError, param: str | None) -> tuple[str, str | None, str]:
    """(message, param, code) of the 400 for an engine's add_request error: an uncompilable
    constraint names its field; anything else is the prompt's."""
    if isinstance(e, StructuredOutputsError):
        return str(e), param, "invalid_structured_output"
    return str(e), None, "invalid_prompt"
