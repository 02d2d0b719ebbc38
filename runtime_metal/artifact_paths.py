"""File names an artifact names itself stay inside the artifact folder.

fuselm.json (`files`, `integrity.files`, `integrity.tensors`) and model.onnx (each external
tensor's `location`) name files by path. Those paths are data from a folder anyone may have
edited, so before fuselm stats, opens or hashes one it must be a relative path below the folder:
no absolute path, no `..` part, and no symlink that leads out. Otherwise `fuselm verify` would
report the size of /etc/passwd, or hash a file the user never meant to hand over.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from fuselm.runtime_metal.manifest_types import ArtifactError


def name_problem(name: object) -> str | None:
    """Why `name` cannot name a file inside an artifact (None: it can), from the text alone."""
    if not isinstance(name, str) or not name.strip():
        return "not a file name"
    if "\x00" in name:
        return "a file name with a NUL byte"
    path = PurePosixPath(name)
    if path.is_absolute():
        return "an absolute path"
    if ".." in path.parts:
        return "a path with a '..' part"
    if path.parts in ((), (".",)):
        return "the folder itself, not a file in it"
    return None


def confined(root: Path, name: object, what: str) -> Path:
    """root/name resolved; one error naming `what` if the name is absolute, climbs out with
    `..`, or resolves (through symlinks) to a place outside `root`: nothing there is stat-ed."""
    problem = name_problem(name)
    if problem is None:
        path = (root / str(name)).resolve()
        if path.is_relative_to(root.resolve()):
            return path
        problem = "a path that leads out of the folder through a symlink"
    raise ArtifactError(
        f"{what} names {name!r} ({problem}); fuselm reads nothing outside the model folder "
        f"{root}, so it refuses it: an artifact's files lie inside its folder, re-run "
        "`fuselm convert`")
