"""`fuselm quant-report OUT_DIR`: how much each quantized tensor lost (4-, 6- or 8-bit blocks;
its bits are a column), worst first.

The figures are recorded at convert time, in fuselm.json's quantization record (one entry per
quantized tensor: relative RMS error sqrt(sum (w' - w)^2 / sum w^2) and bits per weight). The
artifact no longer holds the float weights, so the error cannot be recomputed from it later;
the record costs a few numbers per tensor and keeps the report instant and offline.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from fuselm.converter.errors import UserError
from fuselm.runtime_metal import artifact


def load_record(out_dir: Path) -> dict[str, Any]:
    """The quantization record of an artifact, or a UserError saying what is missing."""
    if not (out_dir / artifact.MANIFEST).is_file():
        raise UserError(f"{out_dir} holds no {artifact.MANIFEST}; pass a fuselm output directory")
    record = artifact.read_manifest(out_dir).quantization
    if not record or not record.get("tensors"):
        raise UserError(f"{out_dir} has no Q4 weights; convert it with --quant q4")
    if any("rel_rms_error" not in t for t in record["tensors"]):
        raise UserError(
            f"{out_dir} was converted before per-tensor errors were recorded; convert it again"
        )
    return record


def rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per quantized tensor, largest relative RMS error first (ties by name)."""
    out = [
        {
            "name": t["name"],
            "role": t["role"],
            "shape": t["shape"],
            "rel_rms_error": t["rel_rms_error"],
            "bits_per_weight": t["bits_per_weight"],
            "block_size": t.get("block_size", record.get("block_size")),
            "bits": t.get("bits", 4),
            "given": t.get("given"),  # the checkpoint's own blocks, kept (e.g. "gguf Q4_1")
        }
        for t in record["tensors"]
    ]
    return sorted(out, key=lambda r: (-r["rel_rms_error"], r["name"]))


def render(record: dict[str, Any] | None, top: int | None = None) -> str:
    """The report as plain text: a summary line, then the table."""
    if not record or not record.get("tensors"):
        return "no Q4 weights"
    table = rows(record)
    bits = record.get("bits", 4)
    q = f"Q{bits}" if isinstance(bits, int) else f"bits {bits.removeprefix('mixed ')}"
    given = record.get("given")
    kept = "" if not given else " · kept from the checkpoint: " + ", ".join(
        f"{k} x{v}" for k, v in given["kept"].items()) + f", {given['quantized']} quantized"
    mixed = record.get("mixed")
    if mixed:  # --quant mixed: which tensors the sensitivity measure put at 6 or 8 bits
        rule = (f"under {mixed['bits_budget']} bits per weight" if "bits_budget" in mixed
                else f"{mixed.get('share', 0):.0%} of the weights")  # an older artifact's
        six = mixed.get("six_bit", [])
        kept += (f" · mixed: {len(mixed['eight_bit'])} tensors at 8 bits"
                 + (f", {len(six)} at 6 bits" if six else "")
                 + f" (the most sensitive per added bit, {rule})")
    lines = [
        f"{q} block {record.get('block_size')} · method {record.get('method', 'minmax')}{kept} · "
        f"{len(table)} tensors · {record.get('bits_per_weight')} bits/weight quantized, "
        f"{record.get('bits_per_weight_overall', '?')} overall · "
        f"LM head {'quantized' if record.get('lm_head') else 'float'} · "
        f"embeddings {'quantized' if record.get('embeddings') else 'float'}",
        f"{'rel RMS err':>11}  {'bits':>4}  {'bits/w':>6}  {'block':>5}  {'role':<24} "
        f"{'shape':<14} name"
        + ("  (kept from)" if given else ""),
    ]
    for r in table[:top] if top else table:
        shape = "x".join(str(d) for d in r["shape"])
        lines.append(
            f"{r['rel_rms_error']:>11.5f}  {r['bits']:>4}  {r['bits_per_weight']:>6.3f}  "
            f"{r['block_size']!s:>5}  "
            f"{r['role']:<24} "
            f"{shape:<14} {r['name']}" + (f"  ({r['given']})" if r["given"] else "")
        )
    return "\n".join(lines)


@click.command("quant-report")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--top", type=click.IntRange(1), default=None, help="Show only the N worst tensors.")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
def quant_report(out_dir: Path, top: int | None, as_json: bool) -> None:
    """Per-tensor Q4 reconstruction error (relative RMS) and bits/weight, worst first."""
    record = load_record(out_dir)
    if as_json:
        summary = {
            k: record.get(k)
            for k in (
                "block_size",
                "bits_budget",
                "mixed",
                "calibration",
                "method",
                "bits_per_weight",
                "bits_per_weight_overall",
                "lm_head",
                "embeddings",
                "roles",
            )
        }
        click.echo(json.dumps({**summary, "tensors": rows(record)[:top]}, indent=2))
    else:
        click.echo(render(record, top))
