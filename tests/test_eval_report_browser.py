"""report.html in a real headless browser (Debian's chromium), driven over the DevTools protocol
on a pipe (no websocket, no extra package): the page loads without console errors or uncaught
exceptions, the plot image decodes, and its screenshot is not blank. Skips when no browser is
installed; CI installs chromium (.ci/run) when apt can."""

from __future__ import annotations

import base64
import fcntl
import io
import json
import os
import select
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from test_eval_report import point_record, sweep_cfg

from quantspec.eval.report import write_report

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")
MIN_PLOT_STDDEV = 10.0  # grey levels; a blank (one-colour) picture has 0, report.png about 50


def find_browser() -> str | None:
    named = os.environ.get("QUANTSPEC_BROWSER")
    return named or next((p for p in map(shutil.which, BROWSERS) if p), None)


@pytest.fixture(scope="module")
def browser() -> str:
    path = find_browser()
    if path is None:
        pytest.skip("no headless browser on PATH: install Debian's chromium (apt-get install chromium) "
                    "or set QUANTSPEC_BROWSER")
    return path


@dataclass
class PageCheck:
    errors: list[str] = field(default_factory=list)  # console errors, uncaught exceptions, failed loads
    plot: dict | None = None  # the #report-plot image: complete, natural and on-page size
    plot_png: bytes | None = None  # a screenshot of the plot's area on the page
    tables: int = 0


def _above_4(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return high


class DevTools:
    """The DevTools protocol over --remote-debugging-pipe: JSON messages ended by NUL, commands
    on the browser's fd 3, replies and events on its fd 4."""

    def __init__(self, browser: str, profile: Path, timeout: float = 60.0):
        cmd_r, self._cmd_w = os.pipe()
        self._resp_r, resp_w = os.pipe()
        cmd_r, resp_w = _above_4(cmd_r), _above_4(resp_w)  # else moving them onto 3 and 4 could clash
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--no-default-browser-check", "--remote-debugging-pipe", f"--user-data-dir={profile}",
                "--window-size=1400,1000", "about:blank"]
        self.proc = subprocess.Popen(  # bash (dash takes no fd past 9) moves the pipe ends to fds 3 and 4
            ["bash", "-c", f'exec "$@" 3<&{cmd_r} 4>&{resp_w} {cmd_r}<&- {resp_w}>&-', "bash", browser, *args],
            pass_fds=(cmd_r, resp_w), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(cmd_r)
        os.close(resp_w)
        self.deadline = time.monotonic() + timeout
        self._buf, self._id, self.events = b"", 0, []

    def _message(self) -> dict:
        while b"\0" not in self._buf:
            left = self.deadline - time.monotonic()
            if left <= 0 or not select.select([self._resp_r], [], [], left)[0]:
                raise TimeoutError("the browser did not answer in time")
            chunk = os.read(self._resp_r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"the browser exited: {self.proc.stderr.read().decode(errors='replace')[-2000:]}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._cmd_w, json.dumps(msg).encode() + b"\0")
        while True:
            reply = self._message()
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str) -> dict:
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self._message())
        return next(e for e in self.events if e.get("method") == method)

    def close(self) -> None:
        try:
            self.call("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._cmd_w)
        os.close(self._resp_r)


_PLOT_JS = """(() => { const i = document.getElementById('report-plot'); if (!i) return null;
  const r = i.getBoundingClientRect();
  return {complete: i.complete, natural_width: i.naturalWidth, natural_height: i.naturalHeight,
          x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height}; })()"""


def _errors(events: list[dict]) -> list[str]:
    out = []
    for e in events:
        m, p = e.get("method"), e.get("params", {})
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console: " + " ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            out.append("exception: " + str(d.get("exception", {}).get("description") or d.get("text")))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append("log: " + p["entry"].get("text", ""))
    return out


def inspect_page(browser: str, page: Path, profile: Path) -> PageCheck:
    """Load ``page`` in the headless browser and report what a person would see wrong."""
    dt = DevTools(browser, profile)
    try:
        target = next(t for t in dt.call("Target.getTargets")["targetInfos"] if t["type"] == "page")
        s = dt.call("Target.attachToTarget", targetId=target["targetId"], flatten=True)["sessionId"]
        for domain in ("Runtime", "Log", "Page"):
            dt.call(f"{domain}.enable", session=s)
        dt.events.clear()  # what about:blank said before is not the page's
        dt.call("Page.navigate", session=s, url=page.resolve().as_uri())
        dt.wait_event("Page.loadEventFired")
        check = PageCheck()
        check.plot = dt.call("Runtime.evaluate", session=s, expression=_PLOT_JS, returnByValue=True)["result"].get("value")
        check.tables = dt.call("Runtime.evaluate", session=s, expression="document.querySelectorAll('table').length",
                               returnByValue=True)["result"]["value"]
        if check.plot and check.plot["width"] > 0 and check.plot["height"] > 0:
            clip = {k: check.plot[k] for k in ("x", "y", "width", "height")} | {"scale": 1}
            shot = dt.call("Page.captureScreenshot", session=s, format="png", clip=clip, captureBeyondViewport=True)
            check.plot_png = base64.b64decode(shot["data"])
        check.errors = _errors(dt.events)
        return check
    finally:
        dt.close()


def plot_stddev(png: bytes) -> float:
    from PIL import Image, ImageStat

    with Image.open(io.BytesIO(png)) as im:
        return ImageStat.Stat(im.convert("L")).stddev[0]


def _report_page(folder: Path) -> Path:
    records = [point_record("dense", None, 16, 20.0, 270.0), point_record("rtn-w4g128-gptq", "rtn", 4, 23.0, 95.0),
               point_record("gptq-w4g128-gptq", "gptq", 4, 22.0, 95.2)]
    write_report(sweep_cfg(speed=False), records, folder)
    return folder / "report.html"


def test_report_page_loads_clean_with_its_plot(browser, tmp_path):
    page = _report_page(tmp_path)
    check = inspect_page(browser, page, tmp_path / "profile")
    assert check.errors == []
    assert check.tables == 1
    from PIL import Image

    with Image.open(tmp_path / "report.png") as im:
        size = im.size
    p = check.plot
    assert p is not None and p["complete"] and (p["natural_width"], p["natural_height"]) == size
    assert p["width"] > 300 and p["height"] > 200  # laid out at a visible size
    assert check.plot_png is not None and plot_stddev(check.plot_png) > MIN_PLOT_STDDEV


def test_checks_catch_errors_and_a_blank_plot(browser, tmp_path):
    from PIL import Image

    white = io.BytesIO()
    Image.new("RGB", (600, 400), "white").save(white, format="PNG")
    data = base64.b64encode(white.getvalue()).decode()
    page = tmp_path / "bad.html"
    page.write_text("<!doctype html><html><head><meta charset='utf-8'><title>bad</title></head><body>"
                    f"<img id='report-plot' src='data:image/png;base64,{data}'>"
                    "<img src='missing-picture.png'>"
                    "<script>console.error('boom from the page'); undefinedFunction();</script></body></html>")
    check = inspect_page(browser, page, tmp_path / "profile")
    text = "\n".join(check.errors)
    assert "boom from the page" in text and "undefinedFunction" in text
    assert "missing-picture.png" in text or any(e.startswith("log: ") for e in check.errors)
    assert check.plot is not None and check.plot_png is not None
    assert plot_stddev(check.plot_png) < MIN_PLOT_STDDEV
    assert check.tables == 0
