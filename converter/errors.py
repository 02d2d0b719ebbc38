"""User errors: one clear line on stderr, a non-zero exit, no traceback.

Each package raises its own error class (export.errors.ExportError, runtime_metal's
ArtifactError, ...); `user_errors()` is the one place that lists them for the CLI.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user; the message names the problem and the fix."""


def user_errors() -> tuple[type[BaseException], ...]:
    from fuselm.export.errors import ExportError
    from fuselm.passes.errors import PassesError
    from fuselm.runtime_metal.artifact import ArtifactError
    from fuselm.runtime_metal.errors import RuntimeUserError

    # PermissionError: a file the user cannot read or a folder they cannot write; its message
    # names the path. It is never a fuselm bug, so it gets one line too.
    return (UserError, ExportError, PassesError, ArtifactError, RuntimeUserError,
            PermissionError)
