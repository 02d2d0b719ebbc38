"""Errors the exporter raises for bad input (unknown architecture, bad checkpoint, ...)."""


class ExportError(Exception):
    """A checkpoint or option fuselm cannot export; the message names the problem and the fix."""
