"""Check that every page of the documentation site fits a 1280-pixel window: no sideways scrolling.

Builds the site (``python -m sphinx -W --keep-going -n -E -q -b html docs build/docs``) unless ``--site`` names a
built one, opens each page in headless Chromium at 1280 x 900 and reports its ``document.documentElement.scrollWidth``
(the width of what can be scrolled to; wider than the window means the page scrolls sideways and its right edge,
with the theme toggle, is cut off). It also reports the sidebar entries that wrap inside a word (a module name such
as ``positional_lsh.integrations.hf`` broken anywhere but after a dot). Exit status 1 when a page is wider than
``--width`` or an entry breaks, 0 otherwise; 2 when there is no Chromium.

    python scripts/check_docs_width.py                  # build, then measure every page
    python scripts/check_docs_width.py --site build/docs --screenshots build/docs-shots

``--screenshots DIR`` writes a PNG of each page's first screen, and of the screen that starts at its first table
or code block that scrolls sideways inside its own box (``PAGE-scrolling.png``), to be looked at. Chromium is found
on the ``PATH`` (``chromium``, ``chromium-browser``, ``google-chrome``) or named by ``$CHROME``; it is driven over
the DevTools protocol on a pipe (``--remote-debugging-pipe``), with the standard library only.
"""

from __future__ import annotations

import argparse
import base64
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WIDTH = 1280
HEIGHT = 900

# Run in the page: its scroll width, the widest element that sticks out of the window, and the sidebar entries
# whose text is laid out on more than one line with a break that is not after a dot (a name cut inside a word).
PROBE = r"""
(() => {
  const width = document.documentElement.scrollWidth;
  let widest = null;
  for (const el of document.querySelectorAll("body *")) {
    if (el.closest(".toc-drawer")) continue;  // folded away to the right on purpose (a fixed drawer)
    const r = el.getBoundingClientRect();
    if (r.right > window.innerWidth + 0.5 && (widest === null || r.right > widest.right)) {
      widest = {right: Math.round(r.right), tag: el.tagName.toLowerCase(), cls: el.className || ""};
    }
  }
  const broken = [];
  for (const a of document.querySelectorAll(".sidebar-tree a")) {
    const text = a.textContent;
    const walker = document.createTreeWalker(a, NodeFilter.SHOW_TEXT);
    let lastTop = null, prev = "";
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (let i = 0; i < node.length; i++) {
        const range = document.createRange();
        range.setStart(node, i); range.setEnd(node, i + 1);
        const rects = range.getClientRects();
        if (!rects.length) continue;
        const top = Math.round(rects[0].top);
        const ch = node.data[i];
        if (lastTop !== null && top > lastTop + 2 && ch !== " " && prev !== " " && prev !== ".") {
          broken.push(text.trim());
        }
        if (ch !== " ") lastTop = top;
        prev = ch;
      }
    }
  }
  let scroller = null;  // the first table or code block that scrolls inside its own box
  for (const el of document.querySelectorAll("article .table-wrapper, article div.highlight pre")) {
    if (el.scrollWidth > el.clientWidth + 1) {
      const r = el.getBoundingClientRect();
      scroller = {top: Math.max(0, Math.round(r.top + window.scrollY) - 60), tag: el.tagName.toLowerCase()};
      break;
    }
  }
  return JSON.stringify({width, widest, broken: [...new Set(broken)], scroller});
})()
"""


@dataclass
class Page:
    """One measured page: its path in the site, scroll width, the widest overflowing element, broken entries."""

    path: str
    width: int
    widest: dict[str, Any] | None
    broken: list[str]


def find_chromium() -> str | None:
    """The Chromium binary: ``$CHROME``, else the first of ``chromium``, ``chromium-browser``, ``google-chrome``."""
    if os.environ.get("CHROME"):
        return os.environ["CHROME"]
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def build_site(out: Path) -> None:
    """Build the HTML site into ``out`` (warnings are errors)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-E", "-q", "-b", "html", "docs", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


class Browser:
    """Headless Chromium driven over the DevTools protocol on a pipe (messages end with a NUL byte)."""

    def __init__(self, binary: str) -> None:
        self.profile = tempfile.mkdtemp(prefix="plsh-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        args = [binary, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu",
                "--disable-dev-shm-usage", "--hide-scrollbars", "--no-first-run", f"--user-data-dir={self.profile}",
                f"--window-size={WIDTH},{HEIGHT}", "about:blank"]  # fmt: skip

        def fds() -> None:  # the protocol's fixed descriptors: commands on 3, replies on 4 (moved out of the way first)
            read, write = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD, 10), fcntl.fcntl(from_browser_w, fcntl.F_DUPFD, 10)
            os.dup2(read, 3)
            os.dup2(write, 4)

        self.proc = subprocess.Popen(args, preexec_fn=fds, close_fds=False, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._id = 0
        self._events: list[dict[str, Any]] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=WIDTH, height=HEIGHT,
                  deviceScaleFactor=1, mobile=False)  # fmt: skip

    def _read(self) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            chunk = os.read(self._from_browser, 1 << 16)
            if not chunk:
                raise RuntimeError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, *, session: bool = False, **params: Any) -> dict[str, Any]:
        """Send one command and wait for its reply (events that arrive meanwhile are kept)."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            message["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self._events.append(reply)

    def wait_event(self, method: str) -> None:
        """Wait for the page's ``method`` event (``Page.loadEventFired``)."""
        while True:
            if any(e.get("method") == method for e in self._events):
                self._events = [e for e in self._events if e.get("method") != method]
                return
            self._events.append(self._read())

    def measure(self, url: str, screenshot: Path | None) -> dict[str, Any]:
        """Load ``url``, run :data:`PROBE` on it after its fonts are ready, optionally save a screenshot."""
        self._events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_event("Page.loadEventFired")
        self.call("Runtime.evaluate", session=True, expression="document.fonts.ready", awaitPromise=True)
        result = self.call("Runtime.evaluate", session=True, expression=PROBE, returnByValue=True)
        found = json.loads(result["result"]["value"])
        if screenshot is not None:
            shot = self.call("Page.captureScreenshot", session=True, format="png")
            screenshot.write_bytes(base64.b64decode(shot["data"]))
            if found.get("scroller"):  # and one screen from the first box that scrolls sideways
                clip = {"x": 0, "y": found["scroller"]["top"], "width": WIDTH, "height": HEIGHT, "scale": 1}
                shot = self.call("Page.captureScreenshot", session=True, format="png", clip=clip,
                                 captureBeyondViewport=True)  # fmt: skip
                screenshot.with_name(screenshot.stem + "-scrolling.png").write_bytes(base64.b64decode(shot["data"]))
        return found

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)


def measure_site(site: Path, binary: str, screenshots: Path | None = None) -> list[Page]:
    """Every HTML page of the built ``site`` (its search and index pages too), measured at 1280 x 900."""
    pages = sorted(p for p in site.rglob("*.html") if "_modules" not in p.parts and "_sources" not in p.parts)
    if screenshots is not None:
        screenshots.mkdir(parents=True, exist_ok=True)
    browser = Browser(binary)
    try:
        out = []
        for page in pages:
            rel = page.relative_to(site).as_posix()
            shot = None if screenshots is None else screenshots / (rel.replace("/", "_").removesuffix(".html") + ".png")
            found = browser.measure(page.resolve().as_uri(), shot)
            out.append(Page(rel, int(found["width"]), found["widest"], list(found["broken"])))
        return out
    finally:
        browser.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--site", type=Path, help="a built HTML site (default: build the docs into build/docs)")
    p.add_argument("--width", type=int, default=WIDTH, help="the widest a page may be, in CSS pixels (1280)")
    p.add_argument("--screenshots", type=Path, help="write a PNG of each page's first screen here")
    args = p.parse_args(argv)
    binary = find_chromium()
    if binary is None:
        print("check_docs_width: no Chromium (install it, e.g. apt-get install chromium, or set $CHROME)",
              file=sys.stderr)  # fmt: skip
        return 2
    site = args.site
    if site is None:
        site = ROOT / "build" / "docs"
        build_site(site)
    pages = measure_site(site, binary, args.screenshots)
    bad = 0
    for page in pages:
        over = page.width > args.width
        bad += over or bool(page.broken)
        note = f"  <- wider than {args.width}: {page.widest}" if over else ""
        note += f"  <- sidebar entries broken inside a word: {page.broken}" if page.broken else ""
        print(f"{page.width:5d}  {page.path}{note}")
    print(f"{len(pages)} pages, {bad} failing (width > {args.width} px or a sidebar name broken inside a word)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
