"""Reading a checkpoint's JSON side files: one error line for unreadable or invalid JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fuselm.export.errors import ExportError
from fuselm.input_files import load_file


def read_json(path: Path, fix: str) -> Any:
    """The parsed JSON of `path`; `fix` says what to do when it is not valid JSON."""
    try:
        return load_file(path)
    except PermissionError as e:
        raise ExportError(f"cannot read {path} ({e.strerror}); check its permissions") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError and JSONTooDeep too
        raise ExportError(f"{path} is not valid JSON ({e}); {fix}") from None
