"""Chinese drill text, part scale."""

ZH_SCALE: dict[str, tuple[str, str]] = {}
