"""User errors: one clear line on stderr, a non-zero exit, no traceback.

Each package raises its own error class (export.errors.ExportError, runtime_metal's
ArtifactError, ...); `user_errors()` is the one place that lists them for the CLI.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user; the message names the problem and the fix."""


def user_errors() -> tuple[type[BaseException], ...]:
    from export.errors import ExportError
    from runtime_metal.artifact import ArtifactError

    errors: list[type[BaseException]] = [UserError, ExportError, ArtifactError]
    try:  # the runtime's own errors, where the runtime defines them
        from runtime_metal.errors import RuntimeUserError

        errors.append(RuntimeUserError)
    except ImportError:
        pass
    return tuple(errors)
