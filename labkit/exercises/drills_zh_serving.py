"""Chinese drill text, part serving."""

ZH_SERVING: dict[str, tuple[str, str]] = {}
