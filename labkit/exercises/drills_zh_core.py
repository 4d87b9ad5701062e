"""Chinese drill text, part core."""

ZH_CORE: dict[str, tuple[str, str]] = {}
TOPICS_ZH: dict[str, str] = {}
