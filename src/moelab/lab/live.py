"""``moelab lab live``: a local web page with the curves, prediction bands and alerts of runs
while they train. Python's http.server serves one HTML page (charts drawn by a small canvas
script, no network needed) and ``data.json``, which the page polls; the run folders are re-read
on each request, so the page follows the runs as metrics.jsonl grows."""

from __future__ import annotations

import errno
import json
import math
import socket
from functools import partial
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import Callable

from moelab.lab import records as rec_mod
from moelab.lab.charts import COLORS, chart_data
from moelab.lab.report import load_record_runs
from moelab.lab.runs import RunData, read_run
from moelab.run.logs import shown_path


def run_sources(targets: list[str], lab: str | None = None
                ) -> tuple[str, Callable[[], list[RunData]]]:
    """(page title, a function that loads the runs now) for a record id or run folders."""
    if len(targets) == 1 and not Path(targets[0]).is_dir():
        try:
            path, rec = rec_mod.find(targets[0], lab)
        except FileNotFoundError as e:  # it may have meant a run folder
            raise FileNotFoundError(f"{e}; or, for runs, give their folders (no folder "
                                    f"{targets[0]} here)") from None

        def from_record() -> list[RunData]:
            # the runs a report counts, now: one attached later shows up, one detached leaves
            return load_record_runs(path, rec_mod.load(path))
        return f"{rec.id}: {rec.title}", from_record
    missing = [t for t in targets if not Path(t).is_dir()]
    if missing:
        raise FileNotFoundError(f"{missing[0]}: not a run folder or record id; give run folders "
                                "(e.g. runs/tiny) or one record id")
    for t in targets:  # a folder of runs, or any other, would serve an empty page
        if not is_run_folder(Path(t)):
            inside = sorted(str(p) for p in Path(t).iterdir() if is_run_folder(p))
            raise FileNotFoundError(
                f"{t}: not a run folder (no config.yaml or metrics.jsonl, which `moelab train` "
                "writes first); " + (f"the run folders in it: {', '.join(inside[:8])}"
                                     + (" ..." if len(inside) > 8 else "") if inside else
                                     "give run folders (e.g. runs/tiny) or one record id"))
    return ", ".join(targets), lambda: [read_run(Path(t)) for t in targets]


def is_run_folder(path: Path) -> bool:
    """Whether ``path`` holds a run, or the start of one: what `moelab train` writes first."""
    return path.is_dir() and any((path / f).is_file() for f in ("config.yaml", "metrics.jsonl"))


def _json_safe(x):
    """NaN/inf become null: the page parses strict JSON."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def _thin(charts: list[dict], max_points: int) -> list[dict]:
    """At most about ``max_points`` points per line (always the newest), so a long run's page
    stays light; the report's plots keep every point."""
    for chart in charts:
        for s in chart["series"]:
            stride = -(-len(s["x"]) // max_points)
            if stride > 1:
                keep = list(range(0, len(s["x"]) - 1, stride)) + [len(s["x"]) - 1]
                s["x"], s["y"] = [s["x"][i] for i in keep], [s["y"][i] for i in keep]
    return charts


def payload(runs: list[RunData], max_points: int = 2000) -> dict:
    """Everything the page shows: run status lines, charts, alerts."""
    return _json_safe({
        "runs": [{"arm": r.name, "path": shown_path(r.path), "status": r.status, "error": r.error,
                  "step": r.last_step, "steps": r.planned_steps, "color": COLORS[i % len(COLORS)]}
                 for i, r in enumerate(runs)],
        "charts": _thin(chart_data(runs), max_points),
        "alerts": [{"arm": r.name, **{k: a.get(k) for k in ("step", "metric", "observed", "lo",
                                                            "hi", "rule")}}
                   for r in runs for a in r.alerts()],
    })


def script_json(obj) -> str:
    """JSON to sit inside a ``<script type="application/json">`` element: ``<``, ``>`` and ``&``
    as \\u escapes, so no ``</script>`` or ``<!--`` in user text can end the element early;
    JSON.parse reads the escapes back as the same characters."""
    text = json.dumps(obj, allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def render_page(title: str, data: dict, refresh_s: float) -> str:
    """The page with its title, refresh interval and data in one JSON element, which the page's
    script reads and shows as text: nothing from a run or a record becomes markup."""
    template = resources.files("moelab.lab").joinpath("live.html").read_text(encoding="utf-8")
    page = script_json({"title": title, "refresh_ms": int(refresh_s * 1000),
                        "data": _json_safe(data)})
    return template.replace("__PAGE_JSON__", page)


class _Handler(BaseHTTPRequestHandler):
    def __init__(self, *args, title: str, load: Callable[[], list[RunData]], refresh_s: float,
                 **kwargs):
        self.title, self.load, self.refresh_s = title, load, refresh_s
        super().__init__(*args, **kwargs)

    def do_GET(self):  # noqa: N802 (http.server's name)
        route = self.path.split("?")[0]
        if route not in ("/", "/data.json"):
            self.send_error(404, "the page is / and its data /data.json")
            return
        try:
            data = payload(self.load())
        except (OSError, ValueError) as e:  # a run folder being written or a bad file
            data = {"runs": [], "charts": [], "alerts": [], "error": str(e)}
        if route == "/":
            body, kind = render_page(self.title, data, self.refresh_s).encode(), "text/html"
        else:
            body, kind = json.dumps(data).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", f"{kind}; charset=utf-8")
        self.send_header("Cache-Control", "no-store")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args):  # keep the terminal for the URL and errors
        pass


def make_server(targets: list[str], lab: str | None = None, host: str = "127.0.0.1",
                port: int = 8765, refresh_s: float = 5.0) -> ThreadingHTTPServer:
    if not refresh_s > 0:
        raise ValueError("--refresh: must be > 0 seconds")
    if not 0 <= port <= 65535:
        raise ValueError(f"--port {port}: must be in 0-65535 (0: any free port)")
    title, load = run_sources(targets, lab)
    load()  # fail now, with a clear message, if a run folder has a bad file
    handler = partial(_Handler, title=title, load=load, refresh_s=refresh_s)
    try:
        return ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise ValueError(bind_error(e, host, port)) from None


def bind_error(e: OSError, host: str, port: int) -> str:
    """The option a failed listen is due to: a host that is no address of this machine (or no
    address at all) is --host's fault, anything else (in use, privileged) the port's."""
    if isinstance(e, socket.gaierror) or e.errno in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
        return (f"--host {host}: cannot listen on it ({e.strerror}); give an address of this "
                "machine, e.g. 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)")
    return (f"--port {port}: cannot listen on {host}:{port} ({e.strerror}); pick another port, "
            "or --port 0 for any free one")


def serve(targets: list[str], lab: str | None = None, host: str = "127.0.0.1", port: int = 8765,
          refresh_s: float = 5.0) -> None:
    server = make_server(targets, lab, host, port, refresh_s)
    h, p = server.server_address[:2]
    print(f"live page: http://{h}:{p}/ (updates every {refresh_s:g} s; Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
