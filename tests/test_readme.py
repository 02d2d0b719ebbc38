"""The README's two commands are real: the demo runs, and CI runs the test command."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S)
    assert block, "README must open with a bash block"
    return [ln.split("#")[0].strip() for ln in block.group(1).splitlines() if ln.strip()]


def test_readme_shows_exactly_two_commands() -> None:
    assert readme_commands() == ["./scripts/demo", "./scripts/test"]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    assert readme_commands()[1] in ci


def test_demo_command_runs(tmp_path: Path) -> None:
    """The demo converts the real SmolLM2-135M-Instruct GGUF to Q4 and answers its question
    through the chat template (greedy, so the answer is fixed)."""
    demo = readme_commands()[0]
    r = subprocess.run(
        [str(ROOT / demo.removeprefix("./")), "-o", str(tmp_path / "q4"), "-n", "16"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert (tmp_path / "q4" / "model.onnx").is_file()
    assert "tg" in r.stderr and "FusedQKV" in r.stderr
    assert "Paris" in r.stdout, r.stdout
    # where the model is and what to try next, with its own paths
    assert f"the model is in {tmp_path / 'q4'}; next, try:" in r.stderr
    # the command as the README's setup installs it (.venv/bin is not on PATH)
    assert f".venv/bin/fuselm chat {tmp_path / 'q4'}" in r.stderr
