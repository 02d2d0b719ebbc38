"""Reading a checkpoint's JSON side files: one error line for unreadable or invalid JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fuselm.export.errors import ExportError


def read_json(path: Path, fix: str) -> Any:
    """The parsed JSON of `path`; `fix` says what to do when it is not valid JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except PermissionError as e:
        raise ExportError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e}); {fix}") from None
