"""Chat templates: how a list of messages becomes the one prompt string a model continues.

A model folder's ``tokenizer_config.json`` may carry a Jinja ``chat_template`` (Hugging Face's
convention); it is rendered in Jinja's sandbox with ``messages``, ``add_generation_prompt=True``,
``bos_token`` and ``eos_token``, as transformers' ``apply_chat_template`` does. labkit's shipped
models are base models with no template, so the documented default is ChatML:

    <|im_start|>system
    You are helpful.<|im_end|>
    <|im_start|>user
    Hi<|im_end|>
    <|im_start|>assistant

The template matters more than it looks: a model fine-tuned on one template and served with
another answers badly, and the generation prompt (the trailing assistant header) is what makes
it answer rather than continue the user's turn.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chatml(messages: list[dict[str, str]]) -> str:
    """The default template in plain Python (no Jinja needed); equals DEFAULT_CHAT_TEMPLATE."""
    body = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return body + "<|im_start|>assistant\n"


def _token(cfg: dict, name: str) -> str:
    t = cfg.get(name) or ""
    return t.get("content", "") if isinstance(t, dict) else str(t)


def load_chat_template(model_dir: str | Path | None) -> tuple[Callable[[list[dict]], str], str]:
    """(render(messages) -> prompt, where the template came from)."""
    f = Path(model_dir) / "tokenizer_config.json" if model_dir else None
    cfg = json.loads(f.read_text()) if f is not None and f.is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # several named templates: take "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"),
                        None)
    if not template:
        return chatml, "default (ChatML)"
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    compiled = env.from_string(template)
    bos, eos = _token(cfg, "bos_token"), _token(cfg, "eos_token")

    def render(messages: list[dict]) -> str:
        return compiled.render(messages=messages, add_generation_prompt=True, bos_token=bos,
                               eos_token=eos)

    return render, str(f)
