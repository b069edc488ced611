"""The documentation site reads the same with no network, as on an operator's air-gapped
host: served from loopback to a headless Chromium whose every other request goes to a dead
proxy, the concepts page's diagram is drawn, and no page asks for an outside host; and every
diagram of the site is legible at the site's default width, its smallest text at least 11 px.

Beside it, the same site built without the mermaid served with it: the diagram stays its
source text and the page asks a CDN for mermaid, so both checks can fail.
"""

from __future__ import annotations

import functools
import html
import http.server
import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.project.test_docs_site import build as build_site
from tests.support.redis_server import free_port

pytest.importorskip("mkdocs", reason="the docs extra is not installed (make setup installs it)")
pytest.importorskip("material", reason="the docs extra is not installed (make setup installs it)")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="needs chromium (make setup)")

PAGES = ("", "concepts/", "getting-started/", "reference/configuration/")
# Chromium's own traffic (updates, accounts) is not the page's, and flags do not stop all
# of it: the page's requests are those that carry the renderer's client hints.
PAGE_REQUEST = re.compile(r"HeadlessChrome|sec-ch-ua")


def build(source: Path, site: Path) -> None:
    done = build_site(source, site)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def sites(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The site as `make docs` builds it, and one built without the served mermaid."""
    work = tmp_path_factory.mktemp("sites")
    build(ROOT, work / "site")
    bare = work / "bare"
    for name in ("docs", "producer"):
        shutil.copytree(ROOT / name, bare / name)
    config = (ROOT / "mkdocs.yml").read_text()
    unserved = re.sub(r"extra_javascript:\n(  - .*\n)+", "", config)
    assert unserved != config
    (bare / "mkdocs.yml").write_text(unserved)
    build(bare, work / "bare-site")
    return {"served": work / "site", "bare": work / "bare-site"}


@pytest.fixture
def serve(sites: dict[str, Path]) -> Iterator[dict[str, str]]:
    """Each site over HTTP on loopback: its base URL."""
    servers = []
    bases = {}
    for name, folder in sites.items():
        handler = functools.partial(Quiet, directory=str(folder))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        bases[name] = f"http://127.0.0.1:{server.server_address[1]}/"
    yield bases
    for server in servers:
        server.shutdown()
        server.server_close()


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def open_offline(url: str, work: Path, width: int = 1280) -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran, and the outside hosts it asked for."""
    assert CHROMIUM is not None
    netlog = work / "netlog.json"
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: no request gets out
    argv = [
        CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu",
        f"--user-data-dir={work / 'profile'}", f"--proxy-server={dead}",
        "--disable-background-networking", "--disable-component-update", "--no-first-run",
        f"--window-size={width},900", "--virtual-time-budget=10000", f"--log-net-log={netlog}",
        "--dump-dom", url,
    ]  # fmt: skip
    done = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    outside = set()
    for event in json.loads(netlog.read_text())["events"]:
        params = event.get("params") or {}
        asked = params.get("url")
        headers = json.dumps(params.get("request_headers", ""))
        if not asked or not PAGE_REQUEST.search(headers):
            continue
        host = urlsplit(asked).hostname
        if host not in ("127.0.0.1", "localhost"):
            outside.add(host or asked)
    return done.stdout, sorted(outside)


@needs_chromium
def test_the_site_reads_the_same_with_no_network(serve: dict[str, str], tmp_path: Path) -> None:
    for i, page in enumerate(PAGES):
        dom, outside = open_offline(serve["served"] + page, tmp_path / f"p{i}")
        assert "</main>" in dom or "md-content" in dom, page
        assert outside == [], f"{page or 'index'} asked for {outside}"
        if page == "concepts/":
            # Drawn: the theme replaced the diagram's source with the rendered diagram.
            assert '<div class="mermaid">' in dom
            assert "<code>flowchart" not in dom


@needs_chromium
def test_without_the_served_mermaid_the_diagram_is_source_text_and_a_cdn_is_asked(
    serve: dict[str, str], tmp_path: Path
) -> None:
    dom, outside = open_offline(serve["bare"] + "concepts/", tmp_path)
    assert "<code>flowchart" in dom and '<div class="mermaid">' not in dom
    assert outside == ["unpkg.com"]


# Written into a copy of each page with a diagram, first in its <head>: the theme draws each
# diagram into a closed shadow root, which no script of the page could read, so they are
# opened; once every diagram is drawn, each one's smallest text as shown on screen (its
# computed font size times the scale the page's width squeezes the svg to) is written into
# the DOM, where --dump-dom carries it out.
MEASURE = """
(function () {
  var roots = [];
  var attach = Element.prototype.attachShadow;
  Element.prototype.attachShadow = function (init) {
    var root = attach.call(this, Object.assign({}, init, {mode: "open"}));
    roots.push(root);
    return root;
  };
  function measure() {
    var blocks = document.querySelectorAll(".mermaid");
    var svgs = [];
    roots.forEach(function (root) {
      root.querySelectorAll("svg").forEach(function (svg) { svgs.push(svg); });
    });
    if (svgs.length < blocks.length) { setTimeout(measure, 100); return; }
    var out = svgs.map(function (svg) {
      var box = svg.getBoundingClientRect();
      var view = svg.viewBox.baseVal;
      var scale = view && view.width ? box.width / view.width : 1;
      var sizes = [];
      svg.querySelectorAll("text, tspan, foreignObject *").forEach(function (el) {
        var own = Array.prototype.some.call(el.childNodes, function (n) {
          return n.nodeType === 3 && n.textContent.trim();
        });
        if (own) sizes.push(parseFloat(getComputedStyle(el).fontSize) * scale);
      });
      return {width: box.width, height: box.height, texts: sizes.length,
              smallest_px: sizes.length ? Math.min.apply(null, sizes) : 0};
    });
    var pre = document.createElement("pre");
    pre.id = "diagram-legibility";
    pre.textContent = JSON.stringify(out);
    document.body.appendChild(pre);
  }
  window.addEventListener("load", function () { setTimeout(measure, 0); });
})();
"""
MEASURED = re.compile(r'<pre id="diagram-legibility">([^<]*)</pre>')
# The site's default width: a 1280 px window, the theme's content column beside its two
# sidebars; 11 px is the smallest text the theme itself sets (its footnotes and tables).
SMALLEST_PX = 11


@needs_chromium
def test_every_diagram_is_legible_at_the_sites_width(
    sites: dict[str, Path], serve: dict[str, str], tmp_path: Path
) -> None:
    site = sites["served"]
    pages = sorted(p for p in site.rglob("index.html") if '<pre class="mermaid">' in p.read_text())
    assert site / "concepts" / "index.html" in pages
    for i, page in enumerate(pages):
        measured = page.with_name("diagram-legibility.html")
        measured.write_text(
            page.read_text().replace("<head>", f"<head><script>{MEASURE}</script>", 1)
        )
        url = serve["served"] + measured.relative_to(site).as_posix()
        dom, _ = open_offline(url, tmp_path / f"p{i}")
        found = MEASURED.search(dom)
        where = page.parent.relative_to(site).as_posix()
        assert found, f"{where}: the diagrams were not drawn"
        diagrams = json.loads(html.unescape(found.group(1)))
        assert diagrams, where
        for n, diagram in enumerate(diagrams, 1):
            assert diagram["texts"] > 0, f"{where} diagram {n}: no text"
            assert diagram["smallest_px"] >= SMALLEST_PX, (
                f"{where} diagram {n}: text {diagram['smallest_px']:.1f} px in"
                f" {diagram['width']:.0f} x {diagram['height']:.0f} px, under {SMALLEST_PX} px"
            )
