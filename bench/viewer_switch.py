"""A layer switch in the attention viewer at 512 tokens (issue 20): how long until the next frame is painted, and until
every line is drawn, in headless Chromium (Debian's ``chromium``, driven by Playwright).

The page is the bundled model's viewer for a 512-token input, every head of the layer shown. The baseline, measured
alongside in the same page, draws every line in one frame (``linesPerFrame = Infinity``): the next frame then waits
for all of them to be rasterised. (Before the head view drew only its visible band, its canvas was the whole 8,200-px
token list and the next frame came after about 4 s.) Printed: the median and worst of --switches layer switches each
way, when the last line was issued (JavaScript time; the painting shows in the next frame), and the ratio of the
next-frame times (target: the next frame within 200 ms).

    .venv/bin/python bench/viewer_switch.py [--switches 8] [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
from pathlib import Path

TARGET_MS = 200.0


def switch_times(page, per_frame: str, switches: int, layers: int) -> list[tuple[float, float]]:
    """(ms to the next frame, ms until every line is drawn) of ``switches`` layer switches with ``per_frame`` lines a frame."""
    page.evaluate(f"window.bertologyViewer.linesPerFrame = {per_frame}")
    times = []
    for k in range(switches):
        page.evaluate("window.bertologyViewer.switchMs = undefined")
        page.select_option("#layer", str((k + 1) % layers))
        page.wait_for_function("window.bertologyViewer.switchMs !== undefined && !window.bertologyViewer.drawing", timeout=120_000)
        times.append((page.evaluate("window.bertologyViewer.switchMs"), page.evaluate("window.bertologyViewer.renderMs")))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--switches", type=int, default=8)
    parser.add_argument("--chromium", default=os.environ.get("BERTOLOGY_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    from bertology.core.model.models import load_model
    from bertology.studies.view.viewer import attention_view

    print(f"load average: {os.getloadavg()[0]:.2f} (torch and chromium share these {os.cpu_count()} cores)")
    text = " ".join(["the quick brown fox jumps over the lazy dog ."] * 60)
    with tempfile.TemporaryDirectory() as folder:
        path = attention_view(text, model=load_model(None, device="cpu")).save(Path(folder) / "long.html")
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1300, "height": 900})
            page.goto(path.as_uri())
            page.wait_for_selector("body[data-ready='1']", timeout=60_000)
            layers = int(page.evaluate("JSON.parse(document.getElementById('bertology-data').textContent).layers"))
            lines = page.evaluate("window.bertologyViewer.linesDrawn")
            results = {}
            for name, per_frame in (("sliced (the viewer)", "600"), ("all in one frame (baseline)", "Infinity"), ("sliced again", "600")):
                results[name] = switch_times(page, per_frame, args.switches, layers)
            browser.close()
    print(f"512 tokens, {layers} layers x 12 heads shown, about {lines} lines in view")
    for name, times in results.items():
        frames, whole = [t[0] for t in times], [t[1] for t in times]
        print(f"{name:30s} next frame median {statistics.median(frames):6.0f} ms, worst {max(frames):6.0f} ms; last line issued after "
              f"{statistics.median(whole):6.0f} ms")
    sliced = [t[0] for name, times in results.items() if name != "all in one frame (baseline)" for t in times]
    baseline = [t[0] for t in results["all in one frame (baseline)"]]
    ratio = statistics.median(sliced) / statistics.median(baseline)
    verdict = "met" if statistics.median(sliced) <= TARGET_MS else "missed"
    print(f"next frame, sliced / one frame: {ratio:.2f}; target {TARGET_MS:.0f} ms to the next frame {verdict}")


if __name__ == "__main__":
    main()
