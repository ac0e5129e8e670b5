"""Drives a real headless Chromium through the DevTools protocol for
tests/dashboard.rs.

    python3 dashboard_browser.py CHROMIUM URL

Opens URL, then answers commands read from stdin, one per line, with one
JSON line on stdout each:
  wait TEXT   waits (up to 20 s) until the page's text contains TEXT, then
              prints {"text", "refreshes", "probe", "navigations"}
  quit        closes the browser

`probe` is a value the driver stores in the page's window after the first
load: if the page reloaded itself it is gone. `navigations` counts the
page's navigations (performance entries).
"""

import asyncio
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request

import websockets


def die_with_parent():
    """In the child before exec: Chromium gets SIGKILL when this driver
    dies, even by SIGKILL (the test's kill_on_drop), and is the leader of
    its own process group, which the driver kills whole at the end."""
    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def stop(browser):
    """Chromium and every process it started (zygote, renderers)."""
    try:
        os.killpg(browser.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    browser.wait()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Page:
    def __init__(self, ws):
        self.ws = ws
        self.next_id = 0

    async def call(self, method, **params):
        self.next_id += 1
        mine = self.next_id
        await self.ws.send(json.dumps({"id": mine, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.recv())
            if msg.get("id") == mine:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    async def eval(self, expression):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")


async def main(chromium, url):
    port = free_port()
    profile = tempfile.mkdtemp(prefix="tollgate-chromium-")
    browser = subprocess.Popen(
        [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-dev-shm-usage", f"--user-data-dir={profile}",
         f"--remote-debugging-port={port}", "--remote-debugging-address=127.0.0.1", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent)
    try:
        targets = None
        for _ in range(300):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=1) as r:
                    targets = [t for t in json.load(r) if t.get("type") == "page"]
                if targets:
                    break
            except OSError:
                pass
            await asyncio.sleep(0.1)
        if not targets:
            raise RuntimeError("Chromium's DevTools endpoint did not come up")
        async with websockets.connect(targets[0]["webSocketDebuggerUrl"], max_size=None) as ws:
            page = Page(ws)
            await page.call("Page.enable")
            await page.call("Page.navigate", url=url)
            probe_set = False
            for line in sys.stdin:
                cmd, _, arg = line.strip().partition(" ")
                if cmd == "quit":
                    print(json.dumps({"quit": True}), flush=True)
                    break
                text = ""
                for _ in range(200):
                    text = await page.eval("document.body ? document.body.innerText : ''") or ""
                    refreshes = await page.eval("document.body ? Number(document.body.dataset.refreshes) : 0") or 0
                    if arg in text and refreshes > 0:
                        break
                    await asyncio.sleep(0.1)
                if not probe_set:
                    await page.eval("window.__tollgateProbe = 'still here'")
                    probe_set = True
                print(json.dumps({
                    "text": text,
                    "refreshes": await page.eval("Number(document.body.dataset.refreshes)"),
                    "probe": await page.eval("window.__tollgateProbe || null"),
                    "navigations": await page.eval("performance.getEntriesByType('navigation').length"),
                }), flush=True)
    finally:
        stop(browser)
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
