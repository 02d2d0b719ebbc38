"""`fuselm cache list | prune | clear`: the converted GGUF files and HF folders that `run`,
`serve`, `fuselm.load` ... keep (converter/model_cache.py: where, and which ones go)."""

from __future__ import annotations

import json

import click


@click.group("cache")
def cache() -> None:
    """The models converted on use from a GGUF file or an HF folder (in
    $XDG_CACHE_HOME/fuselm/converted, else ~/.cache/fuselm/converted). After each conversion
    an entry whose source is gone or changed is removed, and all but the 4 most recently used
    of the others."""


@cache.command("list")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry, in a list.")
def list_command(as_json: bool) -> None:
    """Entries, most recently used first: size, last use, source and its state."""
    from fuselm.converter.model_cache import age, conversion_folder, entries

    found = entries()
    if as_json:
        click.echo(json.dumps([e.to_dict() for e in found], indent=2))
        return
    click.echo(f"{conversion_folder()}: {_count(len(found))}, "
               f"{sum(e.bytes for e in found) / 2**20:.1f} MiB")
    for e in found:
        click.echo(f"  {e.path.name}  {e.bytes / 2**20:.1f} MiB  used {age(e.last_used)}  "
                   f"{e.source or '?'} ({e.state})")


def _count(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _report(removed: list, verb: str) -> None:
    for e, why in removed:
        click.echo(f"removed {e.path} ({why})")
    click.echo(f"{verb}: {_count(len(removed))}, "
               f"{sum(e.bytes for e, _ in removed) / 2**20:.1f} MiB freed")


@cache.command("prune")
def prune_command() -> None:
    """Apply the eviction rule now (it runs after every conversion into the cache), and remove
    the lock files failed conversions left."""
    from fuselm.converter.model_cache import drop_leftovers, evict

    drop_leftovers()
    _report(evict(), "pruned")


@cache.command("clear")
def clear_command() -> None:
    """Remove every entry (an entry being converted into right now is left alone)."""
    from fuselm.converter.model_cache import clear

    _report([(e, "cleared") for e in clear()], "cleared")
