"""The HTML report as a person sees it: rendered by headless Chromium (selenium + chromedriver).

Each report is opened from a file and checked for what only a browser shows: no console errors,
every section there with something in it, every chart drawn with a size, no chart label past its
chart's edge (an SVG clips what lies outside its viewBox), no table cell narrower than its content;
then a screenshot is saved and read back as a PNG.

Chromium and chromedriver are optional (``apt-get install chromium chromium-driver``); without them
these tests skip, unless ``AUTOPAR_REQUIRE_BROWSER=1`` (CI sets it after installing them), where a
missing browser fails.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import zlib

import pytest
from test_report import _plan, _synthetic, pipelined_plan  # noqa: F401  (a fixture, used by name)

import autopar
from autopar.report import TOP_NODES, write_report

REQUIRE = os.environ.get("AUTOPAR_REQUIRE_BROWSER") == "1"
# the network here may be closed: no updates, sync, QUIC or background fetches to wait on
CHROME_FLAGS = (
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--window-size=1280,900",
)  # fmt: skip
# a module path as long as real ones get (a deep encoder-decoder's), to show labels are cut, not clipped
LONG_MODULE = (
    "model.encoder_decoder_backbone.decoder.transformer_layers.27.cross_attention_block."
    "multi_head_attention_with_rotary_position_embeddings.output_projection"
)


def _missing(why: str):
    if REQUIRE:
        pytest.fail(f"AUTOPAR_REQUIRE_BROWSER=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium is not installed (it is in the dev extra: pip install -e '.[dev]')")
    chromium = next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
    )
    driver_path = shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        _missing("no chromium or chromedriver on PATH (apt-get install chromium chromium-driver)")
    options = Options()
    options.binary_location = chromium
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def two_node_plan():
    """A real plan on two nodes of two devices, mesh (2, 2): its outer axis crosses the nodes."""
    from autopar.examples import gpt2_tiny

    model, inputs = gpt2_tiny(batch=8, seq=16, layers=2, hidden=32, vocab=128)
    cluster = autopar.ClusterSpec.preset("cpu", nodes=2, devices_per_node=2)
    return autopar.plan(model, cluster, inputs, mesh_shape=(2, 2))


# what the page shows, measured by the browser: per <h2> its text and the height of what follows it
# up to the next one; per <svg> its drawn size; each <text> of an SVG whose box passes the SVG's
# viewBox; each table cell whose content is wider than the cell
_MEASURE = """
const out = {sections: [], svgs: [], clipped: [], cells: []};
for (const h of document.querySelectorAll('h2')) {
  let el = h.nextElementSibling, height = 0;
  while (el && el.tagName !== 'H2') { height += el.getBoundingClientRect().height; el = el.nextElementSibling; }
  out.sections.push([h.textContent, height]);
}
document.querySelectorAll('svg').forEach((svg, i) => {
  const r = svg.getBoundingClientRect(), vb = svg.viewBox.baseVal;
  out.svgs.push([svg.getAttribute('aria-label'), r.width, r.height]);
  for (const t of svg.querySelectorAll('text')) {
    const b = t.getBBox();
    if (b.x < vb.x - 0.5 || b.y < vb.y - 0.5 || b.x + b.width > vb.x + vb.width + 0.5
        || b.y + b.height > vb.y + vb.height + 0.5)
      out.clipped.push([svg.getAttribute('aria-label'), t.firstChild.textContent,
                        [b.x, b.y, b.width, b.height].map(Math.round), [vb.width, vb.height]]);
  }
});
for (const c of document.querySelectorAll('td, th'))
  if (c.scrollWidth > c.clientWidth + 1) out.cells.push([c.textContent.slice(0, 80), c.scrollWidth, c.clientWidth]);
out.height = document.documentElement.scrollHeight;
out.overflow = document.documentElement.scrollWidth - document.documentElement.clientWidth;
return out;
"""


def _sections(plan) -> list[str]:
    """The report's sections for ``plan``, in order (render_report's layout)."""
    out = ["Summary", "Mesh axes", "Placement notation", "Memory-for-time trades"]
    out += ["Pipeline"] if plan.pipeline.enabled else []
    out += [
        "Predicted memory per device",
        f"Top {min(TOP_NODES, len(plan.decisions))} nodes by predicted time",
    ]
    out += ["Candidate mesh shapes"] if plan.solver.candidates else []
    return out + ["Parameter placements", f"All decisions ({len(plan.decisions)})"]


def _png_size_and_colours(data: bytes) -> tuple[int, int, int]:
    """Width, height and how many distinct byte values its pixel rows hold (a blank image: ~2)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, size = 8, b"", (0, 0)
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    return size[0], size[1], len(set(zlib.decompress(idat)))


def _render_and_check(browser, plan, path) -> dict:
    """Open ``plan``'s report in the browser and check it (module docstring); the measurements."""
    write_report(plan, path)
    browser.get_log("browser")  # drop what earlier pages logged
    browser.get(path.as_uri())
    page = browser.execute_script(_MEASURE)
    severe = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, severe
    assert [s for s, _ in page["sections"]] == _sections(plan)
    assert all(h > 0 for _, h in page["sections"]), page["sections"]
    assert len(page["svgs"]) == 2 + bool(plan.pipeline.enabled) + bool(plan.solver.candidates)
    assert all(w > 0 and h > 0 for _, w, h in page["svgs"]), page["svgs"]
    assert not page["clipped"], page["clipped"]
    assert not page["cells"], page["cells"]
    assert page["overflow"] <= 0, f"the page is {page['overflow']} px wider than the window"
    return page


def _screenshot(browser, page: dict, path) -> None:
    """The whole page (up to 8000 px tall) as a PNG at ``path``, checked to hold a picture."""
    browser.set_window_size(1280, min(page["height"] + 20, 8000))
    assert browser.save_screenshot(str(path))
    width, height, colours = _png_size_and_colours(path.read_bytes())
    assert width >= 1000 and height >= 900 and colours > 16, (width, height, colours)


def test_real_plan_report_renders(browser, two_node_plan, tmp_path):
    page = _render_and_check(browser, two_node_plan, tmp_path / "report.html")
    _screenshot(browser, page, tmp_path / "report.png")


def test_pipelined_plan_report_renders(browser, pipelined_plan, tmp_path):  # noqa: F811
    _render_and_check(browser, pipelined_plan, tmp_path / "report.html")


def test_long_module_paths_are_cut_not_clipped(browser, two_node_plan, tmp_path):
    """Every op in a module with a long path: the node chart's labels keep the path's tail and the
    op, and stay inside the chart; the decisions table grows to hold them."""
    plan = dataclasses.replace(
        two_node_plan,
        decisions=tuple(
            dataclasses.replace(d, module=f"{LONG_MODULE}_{i}") if d.op != "placeholder" else d
            for i, d in enumerate(two_node_plan.decisions)
        ),
    )
    _render_and_check(browser, plan, tmp_path / "report.html")


def test_huge_pipeline_report_renders(browser, tmp_path):
    """64 pipeline ranks, 512 micro-batches (the timeline drawn in part, its long caption)."""
    plan = _synthetic(_plan(), 64, "1f1b", 1, 512)
    _render_and_check(browser, plan, tmp_path / "report.html")


def test_opened_decisions_fit_the_page_and_the_filter_finds_rows(browser, two_node_plan, tmp_path):
    """Every group of "All decisions" opened: no cell narrower than its text, the page no wider than
    the window; typing in the filter keeps the matching rows and counts them."""
    from selenium.webdriver.common.by import By

    path = tmp_path / "report.html"
    write_report(two_node_plan, path)
    browser.get(path.as_uri())
    groups = browser.execute_script("return document.querySelectorAll('details.dg').length")
    assert 1 < groups < len(two_node_plan.decisions)
    browser.execute_script("document.querySelectorAll('details').forEach(d => d.open = true)")
    page = browser.execute_script(_MEASURE)
    assert not page["cells"], page["cells"]
    assert page["overflow"] <= 0, f"the page is {page['overflow']} px wider than the window"
    box = browser.find_element(By.ID, "decision-filter")
    box.send_keys("linear")
    want = sum(1 for d in two_node_plan.decisions if d.op == "aten.linear.default")
    shown = browser.execute_script(
        "return Array.from(document.querySelectorAll('details.dg tbody tr'))"
        ".filter(r => r.offsetParent !== null).map(r => r.cells[1].textContent)"
    )
    assert want > 0 and len(shown) >= want and all("linear" in t for t in shown), shown
    count = browser.find_element(By.ID, "decision-count").text
    assert count == f"{len(shown)} rows match"
    severe = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
    assert not severe, severe


def test_many_candidates_fit_the_page(browser, tmp_path):
    cands = tuple(
        {"mesh_shape": [2, 2, 4], "status": "same as (2, 4, 2)" if i % 2 else "Optimal",
         "objective": 0.01 * (i + 1) if not i % 2 else None, "axis_roles": ["data", "auto", "auto"],
         "trades": {"zero_stage": 3, "recompute": "full", "micro_batches": 32}, "pipeline": {"stages": 8}}
        for i in range(48)
    )  # fmt: skip
    page = _render_and_check(browser, _plan(candidates=cands), tmp_path / "report.html")
    (chart,) = [s for s in page["svgs"] if s[0].startswith("predicted step time")]
    assert chart[1] <= 1100
