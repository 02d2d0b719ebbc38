"""User errors: one clear line on stderr, a non-zero exit, no traceback.

Every package's user error derives from fuselm.errors.FuselmError (export's ExportError,
passes' PassesError, runtime_metal's ArtifactError and RuntimeUserError, UserError here);
`user_errors()` is what the CLI catches.
"""

from __future__ import annotations

from fuselm.errors import FuselmError


class UserError(FuselmError):
    """Bad input from the user; the message names the problem and the fix."""


def user_errors() -> tuple[type[BaseException], ...]:
    # PermissionError: a file the user cannot read or a folder they cannot write; its message
    # names the path. It is never a fuselm bug, so it gets one line too.
    return (FuselmError, PermissionError)
