"""Screenshots of the built documentation site, taken by headless Chromium.

Run from the repository's root after ``mkdocs build --strict``::

    python docs/screenshots.py                      # site/ -> /tmp/safevars-screenshots/
    python docs/screenshots.py --site site --out /tmp/shots --width 1280 --height 2400
    python docs/screenshots.py guide/optimizer/ reference/variables/   # other pages

It serves the built site on 127.0.0.1 (a free port, this process only), takes one PNG per
page with Chromium (``apt-get install -y chromium``; the flags keep it off the network),
prints where each went, and stops the server. Look at the PNGs, with an image viewer or
your editor; do not commit them. CONTRIBUTING.md ("Docs") says what to look for.
"""

from __future__ import annotations

import argparse
import functools
import http.server
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

#: The pages worth a look after a change: the home page, a guide page with long code
#: blocks, a reference page with signatures, the generated results page.
PAGES = ("", "guide/optimizer/", "reference/optimizer/", "benchmark-results/")
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    sys.exit("Chromium not found: apt-get install -y chromium")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pages", nargs="*", default=list(PAGES), help="paths within the site")
    parser.add_argument("--site", default="site", help="the built site (mkdocs build)")
    parser.add_argument("--out", default="/tmp/safevars-screenshots")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--height", type=int, default=2400)
    args = parser.parse_args()
    site, out = Path(args.site).resolve(), Path(args.out)
    if not (site / "index.html").exists():
        sys.exit(f"no built site in {site}: run mkdocs build --strict first")
    out.mkdir(parents=True, exist_ok=True)
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    browser = chromium()
    try:
        for page in args.pages:
            name = page.strip("/").replace("/", "_") or "home"
            target = out / f"{name}.png"
            with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
                subprocess.run(
                    [
                        browser,
                        *CHROMIUM_FLAGS,
                        f"--user-data-dir={profile}",
                        f"--window-size={args.width},{args.height}",
                        f"--screenshot={target}",
                        f"http://127.0.0.1:{server.server_port}/{page.lstrip('/')}",
                    ],
                    check=True,
                    capture_output=True,
                    timeout=120,
                )
            print(target)
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
