"""Check the built book in headless Chromium: ``python -m msrm_lab.notebooks check-book _build/html``.

The HTML is served by ``http.server`` on 127.0.0.1; Playwright opens every page and checks that

- every image loaded (``naturalWidth > 0``);
- the device tables exist: every device present in the results appears as a column of some device table, and the
  device inventory table (``msrm-inventory-table``) has a row for each device;
- maths rendered: pages with maths hold MathJax output (``mjx-container``) and no raw ``\\(`` source is left;
- no request left 127.0.0.1 (anything else is recorded and aborted), and no local request failed (a request the
  browser itself aborted counts only when that file was never served).

:func:`static_check` reads the same HTML without a browser (``check-book --static``, and the ``make check-book``
fallback where no Chromium is installed) and holds every page's main content to what a reader should see:

- tables at most :data:`MAX_TABLE_CELLS` cells wide (index labels included), so their values show on the first
  screen;
- no column of placeholders ("not yet measured", "not measured in this build" or "on this build") and at most
  :data:`MAX_PLACEHOLDERS` such cells per table: an unmeasured device is one line under a table, not a column;
- no raw byte count (an integer of 7 digits or more in a row or table that speaks of bytes);
- every image inside a ``<figure>`` with a non-empty caption;
- no stray plain-text output (the repr of a cell's last value, e.g. ``[]`` or ``4``).
"""
from __future__ import annotations

import functools
import html.parser
import http.server
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

__all__ = ["CHROMIUM_ARGS", "MAX_PLACEHOLDERS", "MAX_TABLE_CELLS", "BookReport", "check_book", "page_failures", "serve", "static_check"]

CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run"]
_LOCAL_SCHEMES = ("data", "blob", "about")
#: the widest table row a page may show, in cells (index labels and values)
MAX_TABLE_CELLS = 9
#: placeholder cells a table may show (a single "not measured" verdict is information; a column of them is not)
MAX_PLACEHOLDERS = 2
_PLACEHOLDERS = ("not yet measured", "not measured in this build", "not measured on this build")
_RAW_INTEGER = re.compile(r"^-?\d{1,3}(,\d{3}){2,}$|^-?\d{7,}$")
_VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class BookReport:
    """What the browser saw. ``ok`` is True when ``failures`` is empty."""

    pages: int = 0
    images: int = 0
    device_tables: int = 0
    math_pages: int = 0
    devices: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        head = (f"book check: {self.pages} pages, {self.images} images, {self.device_tables} device tables, "
                f"{self.math_pages} pages with maths, {len(self.requests)} requests, devices {self.devices}")
        if self.ok:
            return head + "\nall checks passed"
        return head + "\n" + "\n".join(f"FAIL {f}" for f in self.failures)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # noqa: D401 - silence the per-request log
        pass


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # a browser closing a connection early is not an error
        pass


def serve(folder: str | Path) -> tuple[_Server, str]:
    """Serve ``folder`` on 127.0.0.1 (a free port) in a daemon thread; returns ``(server, base_url)``."""
    handler = functools.partial(_Quiet, directory=str(folder))
    server = _Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}/"


_PAGE_JS = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  const imgs = Array.from(document.images);
  for (const img of imgs) { img.loading = 'eager'; try { await img.decode(); } catch (e) {} }
  const tables = Array.from(document.querySelectorAll('table.msrm-device-table, table.msrm-inventory-table'));
  return {
    images: imgs.map(i => ({src: i.currentSrc || i.src, w: i.naturalWidth})),
    tables: tables.map(t => ({
      kind: t.classList.contains('msrm-inventory-table') ? 'inventory' : 'device',
      head: Array.from(t.querySelectorAll('thead th')).map(th => th.textContent.trim()),
      rows: Array.from(t.querySelectorAll('tbody tr')).map(tr => {
        const th = tr.querySelector('th'); return th ? th.textContent.trim() : ''; }),
    })),
    mathSource: document.querySelectorAll('.math').length,
    mathOut: document.querySelectorAll('mjx-container').length,
    rawMath: Array.from(document.querySelectorAll('.math')).filter(
      e => !e.querySelector('mjx-container') && /\\\\\\(|\\\\\\[/.test(e.textContent)).length,
    reprs: Array.from(document.querySelectorAll('.cell_output')).map(e => e.textContent).join(' ')
      .match(/<[A-Za-z_][\\w.]* object(?: at 0x[0-9a-fA-F]+)?>/g) || [],
  };
}"""


def _evaluate(page, timeout_ms: int) -> dict:
    """Run the page probe; a page that navigates on load (index.html redirects) is probed where it lands."""
    from playwright.sync_api import Error

    for attempt in range(3):
        try:
            page.wait_for_load_state("networkidle", timeout=timeout_ms)
            return page.evaluate(_PAGE_JS)
        except Error as exc:
            if "context was destroyed" not in str(exc) or attempt == 2:
                raise
    raise AssertionError("unreachable")


def check_book(html: str | Path, *, results=None, chromium: str = "/usr/bin/chromium",
               timeout_ms: int = 60_000) -> BookReport:
    """Open every page of the built book in headless Chromium and check it (see the module docstring).

    Args:
        html: the built HTML folder (``_build/html``).
        results: results roots the book was built from (default: as :func:`msrm_lab.book.results_roots`).
        chromium: the Chromium executable.
    """
    from playwright.sync_api import sync_playwright

    from .. import book

    html = Path(html)
    if not (html / "index.html").is_file():
        raise ValueError(f"html folder {str(html)!r} holds no index.html: build the book first")
    if not Path(chromium).exists():
        raise ValueError(f"chromium executable {chromium!r} does not exist")
    if isinstance(results, str):
        import os

        results = results.split(os.pathsep)
    devices = book.devices_in(book.load_results(results))
    report = BookReport(devices=devices)
    pages = sorted(p for p in html.rglob("*.html")
                   if not {"_static", "_sources", "_images"} & set(p.relative_to(html).parts))
    server, base = serve(html)
    outside: list[str] = []
    local_failures: list[str] = []
    aborted: list[str] = []
    served: set[str] = set()
    device_heads: set[str] = set()
    inventory_rows: set[str] = set()
    n_inventory = 0
    try:
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
            context = browser.new_context()

            def route(r):
                url = r.request.url
                scheme, host = urlparse(url).scheme, urlparse(url).hostname
                if scheme in _LOCAL_SCHEMES or host == "127.0.0.1":
                    r.continue_()
                else:
                    outside.append(url)
                    r.abort()

            context.route("**/*", route)
            context.on("request", lambda req: report.requests.append(req.url))
            context.on("response", lambda resp: local_failures.append(f"{resp.status} {resp.url}")
                       if resp.status >= 400 else served.add(resp.url))
            # A request the browser aborted because the page moved on (net::ERR_ABORTED: a lazily loaded MathJax
            # font, say) is a failure only if that file was never served; any other failure always counts.
            context.on("requestfailed", lambda req: (aborted if "ABORTED" in str(req.failure or "") else
                                                     local_failures).append(f"failed {req.url}")
                       if urlparse(req.url).hostname == "127.0.0.1" else None)
            page = context.new_page()
            for path in pages:
                rel = path.relative_to(html).as_posix()
                page.goto(base + rel, wait_until="networkidle", timeout=timeout_ms)
                page.evaluate("document.fonts.ready.then(() => true)")  # MathJax loads its fonts lazily
                seen = _evaluate(page, timeout_ms)
                report.pages += 1
                for img in seen["images"]:
                    report.images += 1
                    if not img["w"]:
                        report.failures.append(f"{rel}: image did not load: {img['src']}")
                for t in seen["tables"]:
                    if t["kind"] == "device":
                        report.device_tables += 1
                        device_heads.update(h.split(" (")[0] for h in t["head"])
                    else:
                        n_inventory += 1
                        inventory_rows.update(t["rows"])
                if seen["reprs"]:  # e.g. an empty Markdown output, which has only its plain-text repr to show
                    report.failures.append(f"{rel}: {len(seen['reprs'])} cell output(s) show an object's repr "
                                           f"instead of its content, first {seen['reprs'][0]!r}")
                if seen["mathSource"]:
                    report.math_pages += 1
                    if not seen["mathOut"]:
                        report.failures.append(f"{rel}: {seen['mathSource']} maths elements but no MathJax output")
                    if seen["rawMath"]:
                        report.failures.append(f"{rel}: {seen['rawMath']} maths elements left as raw TeX")
            browser.close()
    finally:
        server.shutdown()
        server.server_close()
    if report.math_pages == 0:
        report.failures.append("no page holds maths: MathJax rendering was not exercised")
    if devices and report.device_tables == 0:
        report.failures.append("no device table (table.msrm-device-table) in the book")
    for d in devices:
        if d not in device_heads:
            report.failures.append(f"device {d} has results but is a column of no device table")
        if n_inventory and d not in inventory_rows:
            report.failures.append(f"device {d} has results but no row in the device inventory table")
    if devices and not n_inventory:
        report.failures.append("no device inventory table (table.msrm-inventory-table) in the book")
    report.failures.extend(f"request left 127.0.0.1: {u}" for u in dict.fromkeys(outside))
    local_failures += [f for f in aborted if f.removeprefix("failed ") not in served]
    report.failures.extend(f"local request failed: {u}" for u in dict.fromkeys(local_failures))
    return report


# ------------------------------------------------------------------------------------------ static check
class _Node:
    __slots__ = ("tag", "attrs", "children", "parent")

    def __init__(self, tag: str, attrs: dict, parent):
        self.tag, self.attrs, self.children, self.parent = tag, attrs, [], parent

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find(self, pred) -> list:
        out = [self] if pred(self) else []
        for c in self.children:
            if not isinstance(c, str):
                out += c.find(pred)
        return out

    def classes(self) -> set:
        return set((self.attrs.get("class") or "").split())


class _Tree(html.parser.HTMLParser):
    """A forgiving DOM: an end tag closes the nearest open element of its name (and everything opened inside it)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = _Node("root", {}, None)
        self.open = self.root

    def handle_starttag(self, tag, attrs):
        node = _Node(tag, dict(attrs), self.open)
        self.open.children.append(node)
        if tag not in _VOID:
            self.open = node

    def handle_endtag(self, tag):
        node = self.open
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.open = node.parent

    def handle_data(self, data):
        self.open.children.append(data)


def page_failures(text: str, rel: str) -> list[str]:
    """What a reader should not see in one built page's main content (module docstring, :func:`static_check`)."""
    tree = _Tree()
    tree.feed(text)
    mains = tree.root.find(lambda n: n.attrs.get("role") == "main" or n.tag == "main")
    main = mains[0] if mains else tree.root
    out = []
    for i, table in enumerate(main.find(lambda n: n.tag == "table"), 1):
        rows = table.find(lambda n: n.tag == "tr")
        cells = [r.find(lambda n: n.tag in ("td", "th")) for r in rows]
        widest = max((len(c) for c in cells), default=0)
        caption = " ".join(table.find(lambda n: n.tag == "caption")[0].text().split())[:60] \
            if table.find(lambda n: n.tag == "caption") else f"table {i}"
        if widest > MAX_TABLE_CELLS:
            out.append(f"{rel}: '{caption}' is {widest} cells wide (at most {MAX_TABLE_CELLS})")
        texts = [[" ".join(c.text().split()) for c in row] for row in cells]
        values = [[" ".join(c.text().split()) for c in row if c.tag == "td"] for row in cells]  # not labels
        holders = sum(t.lower() in _PLACEHOLDERS for row in values for t in row)
        width = max((len(v) for v in values), default=0)
        columns = [[row[j] for row in values if j < len(row)] for j in range(width)]
        empty = sum(bool(col) and all(t.lower() in _PLACEHOLDERS for t in col) for col in columns)
        if empty or holders > MAX_PLACEHOLDERS:
            out.append(f"{rel}: '{caption}' shows {holders} placeholder cell(s)"
                       + (f", {empty} column(s) of nothing else" if empty else ""))
        head_bytes = "bytes" in " ".join(t for row in texts[:2] for t in row).lower()
        raw = [t for row, vals in zip(texts, values) for t in vals
               if _RAW_INTEGER.match(t) and (head_bytes or "bytes" in " ".join(row).lower())]
        if raw:
            out.append(f"{rel}: '{caption}' shows raw byte counts, e.g. {raw[0]}")
    for img in main.find(lambda n: n.tag == "img"):
        fig = img.parent
        while fig is not None and fig.tag != "figure":
            fig = fig.parent
        caps = fig.find(lambda n: n.tag == "figcaption") if fig is not None else []
        if not caps or not caps[0].text().strip():
            out.append(f"{rel}: image {img.attrs.get('src', '?')} has no caption")
    for node in main.find(lambda n: "text_plain" in n.classes() or "output_text" in n.classes()):
        shown = " ".join(node.text().split())
        if shown and len(shown) <= 40:
            out.append(f"{rel}: stray output {shown!r}")
    return out


def static_check(html: str | Path) -> list[str]:
    """:func:`page_failures` of every page of the built book (``_build/html``); an empty list when all pass."""
    html = Path(html)
    if not (html / "index.html").is_file():
        raise ValueError(f"html folder {str(html)!r} holds no index.html: build the book first")
    pages = sorted(p for p in html.rglob("*.html")
                   if not {"_static", "_sources", "_images"} & set(p.relative_to(html).parts)
                   and p.name not in ("genindex.html", "search.html"))
    return [f for p in pages for f in page_failures(p.read_text(encoding="utf-8"), p.relative_to(html).as_posix())]

