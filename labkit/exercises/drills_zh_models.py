"""Chinese drill text, part models."""

ZH_MODELS: dict[str, tuple[str, str]] = {}
