"""User errors: one clear line on stderr, a non-zero exit, no traceback.

Each package raises its own error class (export.errors.ExportError, runtime_metal's
ArtifactError, ...); `user_errors()` is the one place that lists them for the CLI.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user; the message names the problem and the fix."""


def user_errors() -> tuple[type[BaseException], ...]:
    from export.errors import ExportError
    from passes.errors import PassesError
    from runtime_metal.artifact import ArtifactError
    from runtime_metal.errors import RuntimeUserError

    return (UserError, ExportError, PassesError, ArtifactError, RuntimeUserError)
