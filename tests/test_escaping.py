"""User text (record titles, hypotheses, arm names, run folder names, error messages) reaches the
live page only as JSON shown through textContent, and the Markdown report only escaped."""

from __future__ import annotations

import json
import os
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from moelab.lab import records as rec_mod
from moelab.lab.live import payload, render_page, run_sources, script_json
from moelab.lab.report import code_span, evaluate_record, md_text, render_report
from moelab.run.logs import JsonlTracker
from test_lab import _browse  # headless Chromium, as the live-page test runs it

IMG = "<img src=x onerror=alert(1)>"
HOSTILE_TITLE = f"x{IMG} __DATA__ __PAGE_JSON__ </script><!-- **bold** [a](javascript:1)"


def _write_run(run: Path, error: str | None = None) -> Path:
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"train": {"steps": 3}}))
    t = JsonlTracker(run / "metrics.jsonl")
    t.event("start", 0, host=os.uname().nodename, pid=os.getpid())
    for s in (1, 2, 3):
        t.log(s, {"train/loss": 5.0 - s / 10})
    t.event("failed" if error else "finished", 3, **({"error": error} if error else {}))
    t.close()
    return run


@pytest.fixture
def hostile_lab(tmp_path) -> Path:
    """A record with a hostile title, hypothesis and goal; one run in a folder named like HTML,
    one failed run whose error message holds HTML and backticks."""
    path, _ = rec_mod.new_record(tmp_path / "lab", HOSTILE_TITLE, f"# {IMG} *x*\n- y",
                                 f"1. {IMG} `z`", ["train/loss last <= 9"])
    rec_mod.attach(path, _write_run(tmp_path / f"x{IMG}"), "a")
    rec_mod.attach(path, _write_run(tmp_path / "b", error=f"bad `x` {IMG}"), "b")
    return path


class _Elements(HTMLParser):
    """Start tags as a browser's tokenizer sees them, and the text of each script element."""

    def __init__(self):
        super().__init__()
        self.tags, self.scripts, self._in_script = [], [], False

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self.scripts.append("")
            self._in_script = True

    def handle_endtag(self, tag):
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data):
        if self._in_script:
            self.scripts[-1] += data


def _parse(page: str) -> _Elements:
    p = _Elements()
    p.feed(page)
    return p


# ---------------------------------------------------------------- live page


def test_script_json_cannot_end_its_element_and_reads_back_the_same():
    obj = {"t": "</script><script>alert(1)</script> <!-- a & b > c", "n": [1, None]}
    text = script_json(obj)
    assert "<" not in text and ">" not in text and "&" not in text
    assert json.loads(text) == obj


def test_live_page_shows_a_hostile_title_and_run_folder_only_as_json(hostile_lab):
    title, load = run_sources(["1"], str(hostile_lab.parent))
    data = payload(load())
    page = render_page(title, data, 2.5)
    parsed = _parse(page)
    assert [t for t, _ in parsed.tags if t not in ("html", "head", "meta", "title", "style",
                                                    "body", "h1", "div", "h2", "script")] == []
    assert [a.get("type") for t, a in parsed.tags if t == "script"] == ["application/json", None]
    page_json = json.loads(parsed.scripts[0])  # the data did not leak into the title, or back
    assert page_json == {"title": title, "refresh_ms": 2500, "data": data}
    assert page_json["title"].endswith(HOSTILE_TITLE)
    assert any(r["path"].endswith(f"x{IMG}") for r in page_json["data"]["runs"])
    assert page.count("__PAGE_JSON__") == 1  # filled once; the title's copy stays text


def test_live_page_in_chromium_shows_hostile_text_as_text(hostile_lab, tmp_path):
    title, load = run_sources(["1"], str(hostile_lab.parent))
    page = tmp_path / "page.html"
    page.write_text(render_page(title, payload(load()), 60.0), encoding="utf-8")
    dom = _browse(page.as_uri(), tmp_path / "profile", "--dump-dom")
    assert "<img" not in dom and "onerror=alert(1)&gt;" in dom
    h1 = dom[dom.index('<h1 id="title">'):dom.index("</h1>")]
    assert "__DATA__ __PAGE_JSON__ &lt;/script&gt;&lt;!-- **bold**" in h1
    assert "a: finished, step 3/3 (" in dom


# ---------------------------------------------------------------- Markdown report


@pytest.mark.parametrize("text, escaped", [
    ("plain words", "plain words"),
    ("**bold** _it_ `code` [l](u) ![i](u) # h ~s~", r"\*\*bold\*\* \_it\_ \`code\` \[l\](u) "
                                                    r"\!\[i\](u) \# h \~s\~"),
    (IMG, "&lt;img src=x onerror=alert(1)&gt;"),
    ("a & b\n\n# heading\n- item", r"a &amp; b \# heading - item"),
    ("- item", r"\- item"), ("12. item", r"12\. item"), ("> quote", "&gt; quote"),
    (r"back\slash", r"back\\slash"),
])
def test_md_text_escapes_marks_and_html(text, escaped):
    assert md_text(text) == escaped


@pytest.mark.parametrize("text, span", [
    ("runs/a_b", "`runs/a_b`"), ("a `b` c", "``a `b` c``"), ("``x", "``` ``x ```"),
    (IMG, f"`{IMG}`"),
])
def test_code_span_holds_any_backticks(text, span):
    assert code_span(text) == span


def test_report_escapes_title_hypothesis_arms_paths_and_errors(hostile_lab):
    rec = rec_mod.load(hostile_lab)
    runs, verdicts = evaluate_record(hostile_lab, rec)
    text = render_report(rec, runs, verdicts, plots=[("**t**", "loss.png")], generated="now")
    outside_code = re.sub(r"(?<!`)(`+)(?!`).*?(?<!`)\1(?!`)", "", text)  # code spans removed
    assert "<" not in outside_code and "**bold**" not in outside_code
    first = text.splitlines()[0]
    assert first == (r"# x&lt;img src=x onerror=alert(1)&gt; \_\_DATA\_\_ \_\_PAGE\_JSON\_\_ "
                     r"&lt;/script&gt;&lt;\!-- \*\*bold\*\* \[a\](javascript:1): report")
    assert r"**Hypothesis.** \# &lt;img src=x onerror=alert(1)&gt; \*x\* - y" in text
    assert r"**Goal.** 1\. &lt;img src=x onerror=alert(1)&gt; \`z\`" in text
    assert f"`{IMG}`" not in text  # the folder name appears only as part of its path
    assert f"x{IMG}`" in text  # ... inside a code span
    assert "- error: ``bad `x` <img src=x onerror=alert(1)>``" in text
    assert r"![\*\*t\*\*](loss.png)" in text
