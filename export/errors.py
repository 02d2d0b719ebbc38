"""Errors the exporter raises for bad input (unknown architecture, bad checkpoint, ...)."""

from fuselm.errors import FuselmError


class ExportError(FuselmError):
    """A checkpoint or option fuselm cannot export; the message names the problem and the fix."""
