"""The one root of every user error fuselm raises: bad input, named with its fix.

Each package raises its own subclass (converter's UserError, export's ExportError, passes'
PassesError, runtime_metal's ArtifactError and RuntimeUserError); the CLI catches this root
alone and prints one `error:` line, never a traceback. It imports nothing, so every package can
derive from it without an import cycle.
"""

from __future__ import annotations


class FuselmError(Exception):
    """Bad input from the user; the message names the problem and the fix."""
