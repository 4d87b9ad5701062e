"""Chinese drill text, part deploy."""

ZH_DEPLOY: dict[str, tuple[str, str]] = {}
