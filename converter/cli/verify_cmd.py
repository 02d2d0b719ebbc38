"""`fuselm verify OUT_DIR`: hash every file of an artifact against what fuselm.json records.

A damaged data file is reported with the first tensor whose bytes differ (runtime_metal/
integrity.py maps the damaged range back to the ONNX initializer whose external data covers it).
"""

from __future__ import annotations

import json
import time

import click

from fuselm.converter.errors import UserError


def verify_artifact(out_dir: str) -> dict[str, object]:
    """Verify OUT_DIR; raise UserError naming the first bad file (and tensor), else a summary."""
    from fuselm.runtime_metal.artifact import read_manifest
    from fuselm.runtime_metal.integrity import verify

    t0 = time.perf_counter()
    report = verify(out_dir, read_manifest(out_dir))
    problem = report.first_problem()
    if problem is not None:
        raise UserError(f"{out_dir} failed verification: {problem}; copy the folder again or "
                        "re-run `fuselm convert`")
    return {"out_dir": str(out_dir), "files": report.files, "bytes": report.bytes_hashed,
            "seconds": round(time.perf_counter() - t0, 3)}


@click.command("verify")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print a JSON summary on stdout.")
def verify_command(out_dir: str, as_json: bool) -> None:
    """Check OUT_DIR's files against the sizes and SHA-256 hashes in its fuselm.json."""
    summary = verify_artifact(out_dir)
    if as_json:
        click.echo(json.dumps(summary))
    else:
        click.echo(f"ok: {len(summary['files'])} files, {summary['bytes'] / 1e6:.1f} MB "  # type: ignore[operator]
                   f"verified in {summary['seconds']}s", err=True)


verify = verify_command
