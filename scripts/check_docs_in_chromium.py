"""Open the built documentation site in headless Chromium, served on 127.0.0.1 as a reader's browser would get it, and
check that its pages show: every image of the index, the quickstart and the metrics reference decoded and laid out,
the metrics table there, and the site's search answering a query with results.

    sphinx-build -W -b html docs docs/_build/html && python scripts/check_docs_in_chromium.py [docs/_build/html]

Chromium is not a dependency of tandem: on Debian or Ubuntu, `apt-get install chromium`.
"""

import argparse
import functools
import html
import http.server
import json
import re
import shutil
import sys
import tempfile
import threading
from pathlib import Path

from check_report_in_chromium import PROBE, chromium

PAGES = {"index.html": 1, "quickstart.html": 1, "references/metrics.html": 0}
"""The pages checked, with the images each must show at least."""
QUERY = "staleness"


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # one line per request would bury the findings
        pass


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def check_page(binary: str, profile: str, url: str, page: str, least: int) -> list[str]:
    dom = chromium(binary, profile, "--dump-dom", f"{url}/{page}")
    found = re.search(r'<pre id="tandem-probe">(.*?)</pre>', dom, re.DOTALL)
    if not found:
        return [f"{page}: the probe did not run (the page did not finish loading)"]
    images = json.loads(html.unescape(found[1]))
    problems = [
        f"{page}: image {alt or '(no alt)'} did not show ({nw}x{nh}, laid out {w}x{h})"
        for alt, nw, nh, w, h in images
        if not (nw > 0 and nh > 0 and w > 50 and h > 30)
    ]
    if len(images) < least:
        problems.append(f"{page}: {len(images)} images, expected at least {least}")
    if page.endswith("metrics.html") and dom.count("<tr") < 50:
        problems.append(f"{page}: the metrics table has {dom.count('<tr')} rows")
    print(f"  {page}: {len(images)} image(s) shown")
    return problems


def check_search(binary: str, profile: str, url: str) -> list[str]:
    dom = chromium(binary, profile, "--dump-dom", f"{url}/search.html?q={QUERY}")
    results = re.search(r'<ul[^>]*class="search"[^>]*>(.*?)</ul>', dom, re.DOTALL)
    count = results[1].count("<li") if results else 0
    print(f"  search for {QUERY!r}: {count} result(s)")
    return [] if count else [f"search.html?q={QUERY}: no results (the search index did not load or answer)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("site", type=Path, nargs="?", default=Path("docs/_build/html"))
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = parser.parse_args()
    if not (args.site / "index.html").is_file():
        sys.exit(f"{args.site}/index.html does not exist: build the site first (sphinx-build -b html docs {args.site})")
    if not Path(args.chromium).exists():
        sys.exit(f"no Chromium at {args.chromium}: install it (apt-get install chromium) or pass --chromium PATH")
    with tempfile.TemporaryDirectory() as tmp:
        site = Path(tmp) / "site"
        shutil.copytree(args.site, site)
        for page in PAGES:  # the probe writes each image's decoded and shown size into the page once it loaded
            path = site / page
            path.write_text(path.read_text().replace("</body>", PROBE + "</body>"))
        server, url = serve(site)
        try:
            problems = [
                p
                for page, least in PAGES.items()
                for p in check_page(args.chromium, f"{tmp}/profile", url, page, least)
            ]
            problems += check_search(args.chromium, f"{tmp}/profile", url)
        finally:
            server.shutdown()
    if problems:
        sys.exit("\n".join(problems))
    print(f"the site at {args.site} shows in Chromium: {len(PAGES)} pages and the search")


if __name__ == "__main__":
    main()
