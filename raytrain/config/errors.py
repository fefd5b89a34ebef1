"""The one form of a config error: ``key=value: fix``, a ValueError that names the key, the value it
was given and what to do. Every check of a config value raises it through ``require`` (the schema's,
the layout's cut checks, the loader's type checks); the CLI prints it as one line (exit 2).
"""

from __future__ import annotations

from typing import Any


def config_error(key: str, value: Any, fix: str) -> ValueError:
    """``key=value: fix``; a bool is shown as YAML writes it (``true``), anything else as ``repr``."""
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    return ValueError(f"{key}={shown}: {fix}")


def require(ok: bool, key: str, value: Any, fix: str) -> None:
    """Raise ``config_error(key, value, fix)`` unless ``ok``."""
    if not ok:
        raise config_error(key, value, fix)
