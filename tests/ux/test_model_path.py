"""A GGUF file (or an HF folder) is a model every command and `fuselm.load` take: converted
once into the cache, the folder printed, reused until the file changes; a killed or concurrent
conversion never leaves a half-written entry that a later call uses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.export.gguf_files import write_gguf
from tests.ux.conftest import cli

RESOLVE = "import sys; from fuselm.converter.model_path import resolve_model; " \
          "print(resolve_model(sys.argv[1], progress=False))"


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path, _ = write_gguf(tmp_path_factory.mktemp("gguf-model") / "tiny.gguf", "llama", {},
                         seed=5)
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "fuselm" / "converted"


def _entries(cache: Path) -> list[Path]:
    return sorted(p for p in cache.iterdir() if not p.name.startswith(".")) \
        if cache.is_dir() else []


def _run(model: str, *args: str) -> subprocess.CompletedProcess:
    return cli("run", model, "-p", "Hello", "-n", "4", "--engine", "onnxruntime", "--json", *args)


def test_gguf_converted_once_then_reused(tiny_gguf: Path, cache: Path, tmp_path: Path) -> None:
    import fuselm

    first = _run(str(tiny_gguf))
    assert first.returncode == 0, first.stderr
    (entry,) = _entries(cache)
    assert f"converting {tiny_gguf} (GGUF) once into {entry}" in first.stderr
    stamp = (entry / "fuselm.json").stat().st_mtime_ns
    again = _run(str(tiny_gguf))
    assert again.returncode == 0 and f"using {entry}" in again.stderr, again.stderr
    assert "converting" not in again.stderr
    assert json.loads(again.stdout)["tokens"] == json.loads(first.stdout)["tokens"]
    assert (entry / "fuselm.json").stat().st_mtime_ns == stamp  # not written again
    model, _ = fuselm.load(str(tiny_gguf), engine="onnxruntime")
    assert model.path == entry and _entries(cache) == [entry]
    from fuselm.converter.model_path import model_name

    assert model_name(entry) == "tiny"  # what serve calls it: the file's name, no cache key

    # A changed file (same path, new weights) converts again, into a new entry.
    changed = tmp_path / "tiny.gguf"
    write_gguf(changed, "llama", {}, seed=6)
    copy = _run(str(changed))
    assert copy.returncode == 0 and "converting" in copy.stderr
    os.utime(changed, ns=(time.time_ns(), time.time_ns() + 10**9))  # touched: stat differs
    touched = _run(str(changed))
    assert "converting" in touched.stderr, touched.stderr
    # the entry of the file before it was touched is stale: removed after the new conversion
    assert "from the cache (source changed)" in touched.stderr, touched.stderr
    assert len(_entries(cache)) == 2 and all((e / "fuselm.json").is_file()
                                              for e in _entries(cache))


def test_cache_evicts_stale_and_least_recently_used(tiny_gguf: Path, cache: Path,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """After a conversion: entries whose source is gone or changed are removed, then all but
    the KEEP most recently used; `fuselm cache list / prune / clear` show and apply it."""
    import shutil

    from fuselm.converter.model_cache import KEEP, cache_entry, mark_used
    from fuselm.converter.model_path import resolve_model

    first = resolve_model(tiny_gguf, progress=False)
    sources = []
    for i in range(KEEP + 1):  # entries of copies of the file (each path its own entry)
        src = tmp_path / f"copy{i}.gguf"
        shutil.copy(tiny_gguf, src)
        entry = cache_entry(src)
        shutil.copytree(first, entry)
        mark_used(entry, src)
        os.utime(entry.parent / f".{entry.name}.source", (i + 10, i + 10))  # oldest first
        sources.append((src, entry))
    sources[0][0].unlink()  # gone
    os.utime(sources[1][0], ns=(time.time_ns(), time.time_ns() + 10**9))  # changed
    listed = json.loads(cli("cache", "list", "--json").stdout)
    assert [e["path"] for e in listed][0] == str(first)  # most recently used first
    states = {e["path"]: e["state"] for e in listed}
    assert states[str(sources[0][1])] == "source missing"
    assert states[str(sources[1][1])] == "source changed"
    assert states[str(sources[2][1])] == "current"
    text = cli("cache", "list").stdout
    assert text.startswith(f"{cache}: {KEEP + 2} entries") and "(source missing)" in text

    # a new conversion: the two stale entries go, then the least recently used beyond KEEP
    new = tmp_path / "new.gguf"
    shutil.copy(tiny_gguf, new)
    capsys.readouterr()
    resolve_model(new, progress=False)
    err = capsys.readouterr().err
    assert f"removed {sources[0][1]} from the cache (source missing)" in err
    assert f"removed {sources[1][1]} from the cache (source changed)" in err
    assert f"removed {sources[2][1]} from the cache (beyond the {KEEP} most recently used)" \
        in err
    kept = {cache_entry(new), first, *(e for _, e in sources[3:])}
    assert set(_entries(cache)) == kept and len(kept) == KEEP
    for _, gone in sources[:3]:  # its record and lock file with it
        assert not list(cache.glob(f".{gone.name}.*"))
    assert resolve_model(sources[3][0], progress=False) == sources[3][1]  # used, not converted
    assert "removed" not in capsys.readouterr().err

    assert cli("cache", "prune").stdout.strip() == "pruned: 0 entries, 0.0 MiB freed"
    cleared = cli("cache", "clear")
    assert cleared.returncode == 0 and f"cleared: {KEEP} entries" in cleared.stdout
    assert _entries(cache) == [] and not list(cache.glob(".*.source"))


def test_every_command_takes_a_gguf(tiny_gguf: Path, cache: Path) -> None:
    for args in (["bench", str(tiny_gguf), "-p", "8", "-n", "2", "-r", "1", "--engine",
                  "onnxruntime"],
                 ["perplexity", "-m", str(tiny_gguf), "--context", "16", "--engine",
                  "onnxruntime"]):
        r = cli(*args)
        assert r.returncode == 0, (args, r.stderr)
        assert str(cache) in r.stderr
    assert len(_entries(cache)) == 1


def test_missing_gguf_is_one_error_line(tmp_path: Path) -> None:
    r = _run(str(tmp_path / "nope.gguf"))
    missing = tmp_path / "nope.gguf"
    assert r.returncode == 2 and r.stderr.strip() == f"error: {missing}: no such file"


def test_killed_conversion_leaves_no_entry(tiny_gguf: Path, cache: Path) -> None:
    env = {**os.environ}
    proc = subprocess.Popen([sys.executable, "-c", RESOLVE, str(tiny_gguf)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (cache.is_dir() and any(".tmp-" in p.name for p in cache.iterdir())):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not any((e / "fuselm.json").is_file() for e in _entries(cache))
    from fuselm.converter.model_path import resolve_model

    entry = resolve_model(tiny_gguf, progress=False)
    assert (entry / "fuselm.json").is_file()
    assert not [p for p in cache.iterdir() if ".tmp-" in p.name]  # the dead build removed


def test_concurrent_calls_convert_once(tiny_gguf: Path, cache: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", RESOLVE, str(tiny_gguf)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    (entry,) = _entries(cache)
    assert {o[0].strip() for o in outs} == {str(entry)}
    assert sum(" once into " in o[1] for o in outs) == 1, outs


def test_validate_a_gguf_without_an_hf_folder(tiny_gguf: Path, cache: Path,
                                              tmp_path: Path) -> None:
    """The reference is the GGUF's own dequantized weights in float32: the default conversion
    (cache) and an explicit one both pass."""
    r = cli("validate", str(tiny_gguf), "-n", "4", "--no-ppl")
    assert r.returncode == 0, r.stderr + r.stdout
    assert "dequantized weights in HF float32" in r.stdout
    assert r.stdout.rstrip().endswith("verdict: PASS")
    out = tmp_path / "q4"
    assert cli("convert", str(tiny_gguf), "-o", str(out), "-q", "--quiet").returncode == 0
    r = cli("validate", str(tiny_gguf), str(out), "-n", "4", "--json")
    assert r.returncode == 0, r.stderr
    verdict = json.loads(r.stdout)["verdicts"]["onnxruntime"]
    assert verdict["status"] in ("PASS", "WARN") and "PPL" in verdict["reason"], verdict


@pytest.mark.parametrize("command", ["run", "bench", "perplexity"])
def test_empty_model_is_a_usage_error(command: str) -> None:
    """`fuselm bench ""`: an empty MODEL is a usage error naming it (exit 2), no traceback."""
    r = subprocess.run([sys.executable, "-m", "fuselm.converter.cli.main", command, ""],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "MODEL is empty" in r.stderr
    assert "Traceback" not in r.stderr


def test_unwritable_cache_folder_is_one_error_line(tiny_gguf: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache folder that cannot be made (XDG_CACHE_HOME under a file) is one error line that
    names it and the way around it, not a traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "xdg"))
    r = _run(str(tiny_gguf))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and str(blocker) in lines[0] \
        and "fuselm convert" in lines[0], lines[0]


def test_prune_and_clear_remove_what_failed_conversions_left(tmp_path: Path, cache: Path
                                                             ) -> None:
    """A GGUF whose conversion fails leaves its lock file (and no entry) in the cache: `cache
    prune` removes it, as does `cache clear`; a complete entry's files stay with prune."""
    for command in ("prune", "clear"):
        bad = tmp_path / f"bad-{command}.gguf"
        bad.write_bytes(b"GGUF" + b"\0" * 60)
        assert _run(str(bad)).returncode != 0
        assert list(cache.glob(".*.wait")), "the failed conversion left no lock to test"
        r = cli("cache", command)
        assert r.returncode == 0, r.stderr
        assert not list(cache.glob(".*.wait")) and not list(cache.glob(".*.source"))
