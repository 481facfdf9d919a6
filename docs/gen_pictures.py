"""Render the documentation's pictures (docs/images/) from real runs, in the tests' browser.

    python docs/gen_pictures.py              # rewrite docs/images/*.png
    python docs/gen_pictures.py --out DIR    # write them into DIR instead

The pictures are screenshots of what a user gets, never drawn by hand: the HTML report of a
real run of a negative control (its explanation box and checks, and one counterexample's M2
removal curve) and the bench's HTML page. They use the Debian Chromium the browser tests use
(``bash .ci/install-browser``) driven by playwright, with the same flags.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
#: The run the report pictures come from: a planted off-by-one in the selection, caught and named.
CONTROL, EXAMPLES = "control:one_extra_removed", 60


def _reports(scratch: Path) -> dict[str, Path]:
    from m2po_oracle.bench.core import run_bench
    from m2po_oracle.call.resolve import load_implementation
    from m2po_oracle.compare.search import run_compare
    from m2po_oracle.report.bench_html import write_bench_html
    from m2po_oracle.report.html import write_html

    compare = scratch / "compare.html"
    write_html(run_compare(load_implementation(CONTROL), CONTROL, examples=EXAMPLES).to_json(), compare)
    bench = scratch / "bench.html"
    write_bench_html(run_bench([1 << e for e in (12, 14, 16, 18)], repeats=3, device="cpu"), bench)
    return {"compare": compare, "bench": bench}


def render(out: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    if not CHROMIUM.exists():
        raise SystemExit(f"gen_pictures: needs Debian chromium at {CHROMIUM} (bash .ci/install-browser)")
    out.mkdir(parents=True, exist_ok=True)
    written = []
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as playwright:
        pages = _reports(Path(tmp))
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1100}, device_scale_factor=1)
            page.set_default_timeout(30_000)
            page.goto(pages["compare"].as_uri(), wait_until="load")
            written.append(out / "report.png")
            page.screenshot(path=str(written[-1]), full_page=False)
            written.append(out / "removal-curve.png")
            page.locator("svg.removal-curve").first.screenshot(path=str(written[-1]))
            page.goto(pages["bench"].as_uri(), wait_until="load")
            written.append(out / "bench.png")
            page.locator("svg").first.screenshot(path=str(written[-1]))
        finally:
            browser.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images", help="where to write the PNG files")
    for path in render(parser.parse_args(argv).out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
