"""Open a run's report.html once in headless Chromium and check that every plot shows.

A copy of the page gets a script that, once the page has loaded, writes each <img>'s decoded size into the DOM;
Chromium's --dump-dom prints that DOM. Every image must have decoded (a natural width above zero) and be laid
out at a visible size. With --screenshot PATH, a picture of the top of the page is saved too.

    python scripts/check_report_in_chromium.py RUN_DIR [--chromium /usr/bin/chromium] [--screenshot PATH]

Chromium is not a dependency of tandem: on Debian or Ubuntu, `apt-get install chromium`.
"""

import argparse
import html
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROBE = """<script>
window.addEventListener("load", () => {
  const seen = [...document.images].map(i => [i.alt, i.naturalWidth, i.naturalHeight, i.width, i.height]);
  const out = document.createElement("pre");
  out.id = "tandem-probe";
  out.textContent = JSON.stringify(seen);
  document.body.appendChild(out);
});
</script>"""
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-sync",
    "--disable-background-networking",
    "--disable-component-update",
    "--virtual-time-budget=10000",
]


def chromium(binary: str, profile: str, *args: str) -> str:
    done = subprocess.run(
        [binary, *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        sys.exit(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    parser.add_argument("--screenshot", type=Path, help="also save a 1100x800 picture of the page's top here")
    args = parser.parse_args()
    page = args.run_dir / "report.html"
    if not page.is_file():
        sys.exit(f"{page} does not exist: write it with `tandem report {args.run_dir}`")
    if not Path(args.chromium).exists():
        sys.exit(f"no Chromium at {args.chromium}: install it (apt-get install chromium) or pass --chromium PATH")
    with tempfile.TemporaryDirectory() as tmp:
        probed = Path(tmp) / "report.html"
        probed.write_text(page.read_text().replace("</html>", PROBE + "</html>"))
        dom = chromium(args.chromium, f"{tmp}/profile", "--dump-dom", probed.as_uri())
        if args.screenshot:
            chromium(
                args.chromium,
                f"{tmp}/profile",
                f"--screenshot={args.screenshot.resolve()}",
                "--window-size=1100,800",
                page.resolve().as_uri(),
            )
    found = re.search(r'<pre id="tandem-probe">(.*?)</pre>', dom, re.DOTALL)
    if not found:
        sys.exit("the page's probe did not run: Chromium did not finish loading the report")
    images = json.loads(html.unescape(found[1]))
    broken = [
        alt
        for alt, natural_w, natural_h, w, h in images
        if not (natural_w > 0 and natural_h > 0 and w > 100 and h > 50)
    ]
    for alt, natural_w, natural_h, w, h in images:
        print(f"  {alt}: {natural_w}x{natural_h} px, shown at {w}x{h}")
    if not images or broken:
        sys.exit(f"{len(broken)} of {len(images)} images did not show: {broken}")
    print(f"all {len(images)} images of {page} show in Chromium")


if __name__ == "__main__":
    main()
