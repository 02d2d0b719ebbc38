"""The passes' user error: bad options (or a model the passes cannot take), named with the fix.
The CLI reports it like every package's user error (converter/errors.py lists them)."""

from __future__ import annotations

from fuselm.errors import FuselmError


class PassesError(FuselmError):
    """Bad input to the graph passes; the message names the problem and the fix."""
