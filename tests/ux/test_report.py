"""`fuselm report`: the HTML page renders in a real headless Chromium (Debian's package):
drawings and charts have a size, nothing logs an error to the console."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.browser import browser
from tests.ux.conftest import cli, convert


@pytest.fixture(scope="module")
def artifact(hf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ux artifact, a default conversion: the exporter writes the plain decoder graph, so
    the report's before/after drawings show the passes' fusion."""
    return convert(hf_dir, tmp_path_factory.mktemp("ux-default") / "out")


def render(page: Path, tmp_path: Path) -> dict[str, tuple[int, int]]:
    """Load the page, screenshot it, return the rendered size of each drawing and chart."""
    from selenium.webdriver.common.by import By

    driver = browser(tmp_path / "chromium-profile")
    try:
        driver.get(page.resolve().as_uri())
        assert driver.save_screenshot(str(tmp_path / "report.png"))
        sizes = {el.get_attribute("id"): (el.size["width"], el.size["height"])
                 for el in driver.find_elements(By.CSS_SELECTOR, "svg[id]")}
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        text = driver.find_element(By.TAG_NAME, "body").text
    finally:
        driver.quit()
    assert not errors, errors
    assert (tmp_path / "report.png").stat().st_size > 10_000
    sizes["_text"] = text  # type: ignore[assignment]
    return sizes


def test_report_renders_in_headless_chromium(artifact: Path, tmp_path: Path) -> None:
    recorded = json.loads((artifact / "fuselm.json").read_text())["passes"]["layer_before"]
    assert [n["op"] for n in recorded].count("MatMul") >= 3  # q, k, v not yet fused
    page = tmp_path / "report.html"
    r = cli("report", str(artifact), "-o", str(page), "--profile")
    assert r.returncode == 0, r.stderr
    sizes = render(page, tmp_path)
    for drawing in ("layer-before", "layer-after", "histogram", "profile"):
        w, h = sizes[drawing]
        assert w > 100 and h > 50, (drawing, sizes[drawing])
    # before fusion the layer has more nodes than after (QKV and gate/up fused)
    assert sizes["layer-before"][1] > sizes["layer-after"][1]
    text = sizes["_text"]
    assert "qkv" in text and "fuselm.FusedQKV +2" in text and "not quantized" in text
    assert "as exported, before the passes" in text
    passes = json.loads((artifact / "fuselm.json").read_text())["passes"]["passes"]
    idle = [p["name"] for p in passes if not p["matches"] and not p.get("op_delta")]
    assert idle and text.count("no match: none of its pattern in the graph") == len(idle)


def test_report_q4_error_chart_or_not_recorded(artifact: Path, tmp_path: Path) -> None:
    q4 = tmp_path / "q4"
    shutil.copytree(artifact, q4)
    manifest = json.loads((q4 / "fuselm.json").read_text())
    manifest["quantization"] = {"bits": 4, "block_size": 32, "symmetric": False}
    (q4 / "fuselm.json").write_text(json.dumps(manifest))
    assert cli("report", str(q4)).returncode == 0
    assert "not recorded" in (q4 / "report.html").read_text()
    # A quantizer that records per-tensor error gets a chart.
    # (the record's shape is the quantizer's: see passes/quant/quantize.py and quant-report)
    manifest["quantization"]["tensors"] = [
        {"name": n, "role": "linear", "shape": [64, 64], "rel_rms_error": e,
         "bits_per_weight": 4.625}
        for n, e in (("model.layers.0.mlp.down_proj", 0.031),
                     ("model.layers.1.self_attn.q_proj", 0.012))]
    (q4 / "fuselm.json").write_text(json.dumps(manifest))
    assert cli("report", str(q4), "-o", str(tmp_path / "r.html")).returncode == 0
    sizes = render(tmp_path / "r.html", tmp_path)
    assert sizes["quant-error"][0] > 100 and "down_proj" in sizes["_text"]


def test_times_read_in_human_units() -> None:
    from fuselm.converter.report.svg_charts import bar_chart, shown

    assert [shown(v, "ms") for v in (0.0123, 12.3, 999, 35_700, 240_000)] == [
        "12.3 µs", "12.3 ms", "999 ms", "35.7 s", "4 min"]
    chart = bar_chart([("fuselm.FusedQKV", 35_700.0), ("Add", 12.5)], "ms", "profile")
    assert ">35.7 s</text>" in chart and ">12.5 ms</text>" in chart and "e+" not in chart


def test_unwritable_output_is_one_error_line(artifact: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    r = cli("report", str(artifact), "-o", str(blocker / "sub" / "report.html"))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "-o" in lines[0]


def test_profile_and_profile_json_are_one_or_the_other(artifact: Path, tmp_path: Path) -> None:
    times = tmp_path / "p.json"
    times.write_text(json.dumps({"profile": [{"op": "MatMul", "calls": 1, "total_ms": 1.0,
                                              "percent": 100.0}]}))
    r = cli("report", str(artifact), "-o", str(tmp_path / "r.html"), "--profile",
            "--profile-json", str(times))
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "--profile-json" in lines[0], r.stderr
    assert not (tmp_path / "r.html").exists()
