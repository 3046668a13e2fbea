"""The browser playground at `/` (`--no-webui` leaves it out), driven in a real headless Chromium
(Debian's `chromium`, through Playwright) against a real server: a chat reply streams in, a
decision draws its bars and replays through /v1/score, the live metrics agree with /metrics.

Without /usr/bin/chromium the browser tests skip, unless LADLE_REQUIRE_BROWSER=1 (as CI sets it).
Screenshots go to $LADLE_TEST_ARTIFACTS, else to a temporary directory; each test prints its path.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from server_utils import MODEL, Server, ServerThread, own_server

from ladle.config import EngineConfig
from ladle.cli import subcommand_parser
from ladle.server import cli as serve_cli
from ladle.server.app import create_app

CHROMIUM = "/usr/bin/chromium"
KEY = "playground-key"
WAIT_MS = 120_000  # a 2-core CPU shared with other work
MAX_TOKENS = 32
TICKET = "Since this morning's update the integration keeps failing with a timeout."
QUESTION = "Which team should handle this ticket?"
OPTIONS = [{"name": "billing"}, {"name": "technical", "description": "bugs and outages"}, {"name": "sales"}]

# Records the streaming reply's length at every change to the conversation, as the page sees it.
WATCH_REPLY = """() => {
  window.replyLengths = [];
  new MutationObserver(() => {
    const reply = [...document.querySelectorAll(".msg.assistant")].pop();
    if (reply?.dataset.state === "streaming") window.replyLengths.push(reply.textContent.length);
  }).observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
}"""


def require_browser() -> None:
    problem = (f"{CHROMIUM} is missing (Debian: apt-get install chromium)" if not os.path.exists(CHROMIUM)
               else "the playwright package is missing" if importlib.util.find_spec("playwright") is None else None)
    if problem and os.environ.get("LADLE_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{problem}, and LADLE_REQUIRE_BROWSER=1 requires the browser tests to run")
    if problem:
        pytest.skip(f"{problem}: the browser tests of the playground do not run")


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    """A private server: decisions warm the prefix cache that the session server's tests expect cold."""
    with own_server(EngineConfig(num_kv_blocks=256)) as s:
        yield s


@pytest.fixture(scope="module")
def browser():
    require_browser()
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT_MS)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = Path(os.environ.get("LADLE_TEST_ARTIFACTS") or tmp_path_factory.mktemp("webui"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def open_page(browser, url: str, key: str | None = None, only_under: str | None = None):
    """The playground at `url` in a fresh 1280x800 tab, the API key entered; JavaScript errors collected.
    only_under: refuse requests for paths outside this prefix, as a proxy serving ladle there would."""
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.set_default_timeout(WAIT_MS)
    page.errors = []
    page.on("pageerror", lambda e: page.errors.append(str(e)))
    if only_under:
        page.route("**/*", lambda route: route.continue_() if urlsplit(route.request.url).path.startswith(only_under)
                   else route.abort())
    page.goto(url)
    if key:
        page.fill("#api-key", key)
        page.press("#api-key", "Enter")
    expect(page.locator("#model")).to_have_text(MODEL)
    return page


@pytest.fixture
def page(browser, server: Server):
    page = open_page(browser, f"{server.url}/")
    yield page
    errors = page.errors
    page.close()
    assert not errors, errors


def screenshot(page, artifacts: Path, name: str, capsys: pytest.CaptureFixture) -> None:
    page.evaluate("window.scrollTo(0, 0)")
    path = artifacts / f"{name}.png"
    page.screenshot(path=str(path))
    with capsys.disabled():
        print(f"\nplayground screenshot: {path}")


def greedy_reply(server: Server, messages: list[dict]) -> str:
    r = httpx.post(f"{server.base_url}/chat/completions", timeout=300, json={
        "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def send(page, text: str):
    """Types a message, sends it with Enter, waits for the reply's stream to end; returns the reply."""
    from playwright.sync_api import expect

    page.fill("#chat-input", text)
    page.press("#chat-input", "Enter")
    reply = page.locator(".msg.assistant").last
    expect(reply).to_have_attribute("data-state", "done")
    return reply.text_content()


def test_chat_streams_the_reply(page, server: Server, artifacts: Path, capsys: pytest.CaptureFixture) -> None:
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.evaluate(WATCH_REPLY)
    first = [{"role": "user", "content": "Name three rivers in Europe."}]
    reply = send(page, first[0]["content"])
    assert reply == greedy_reply(server, first)  # the streamed text is the whole reply
    partial = {n for n in page.evaluate("window.replyLengths") if 0 < n < len(reply)}
    assert len(partial) >= 2, "the reply did not appear piece by piece while it streamed"
    # the next turn sends the conversation so far
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Which is the longest?"}]
    assert send(page, second[-1]["content"]) == greedy_reply(server, second)
    assert page.locator(".msg.user").count() == 2
    screenshot(page, artifacts, "chat", capsys)
    page.click("#reset")
    assert page.locator(".msg").count() == 0


def test_decision_draws_bars_and_replays(page, server: Server, artifacts: Path,
                                        capsys: pytest.CaptureFixture) -> None:
    from playwright.sync_api import expect

    page.click("button[data-tab=decisions]")
    page.fill("#d-input", TICKET)
    page.fill("#d-question", QUESTION)
    page.fill("#d-options", "\n".join(o["name"] + (f" - {o['description']}" if "description" in o else "")
                                      for o in OPTIONS))
    page.fill("#d-temperature", "0.7")
    page.click("#decide")
    body = {"model": MODEL, "input": TICKET, "temperature": 0.7, "return_prompt_token_ids": True,
            "questions": [{"id": "decision", "type": "choice", "question": QUESTION, "options": OPTIONS}]}
    r = httpx.post(f"{server.base_url}/decisions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    answer = r.json()["answers"]["decision"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": answer["prompt_token_ids"]}).json()["prompt"]
    expect(page.locator("#prompt")).to_have_text(prompt)

    bars = page.locator(".bar")
    expect(bars).to_have_count(len(OPTIONS))
    for bar, (name, p) in zip(bars.all(), answer["probabilities"].items(), strict=True):
        assert bar.get_attribute("data-option") == name
        assert float(bar.get_attribute("data-p")) == pytest.approx(p, abs=1e-6)
        assert bar.locator(".pct").text_content() == f"{100 * p:.1f}%"
        track, fill = bar.locator(".track").bounding_box(), bar.locator(".fill").bounding_box()
        assert fill["width"] == pytest.approx(p * track["width"], abs=1.0)  # the bar is drawn to scale
    expect(page.locator(".bar.chosen .name")).to_have_text(answer["choice"])
    mass = page.locator("#label-mass")
    assert float(mass.get_attribute("data-value")) == pytest.approx(answer["label_mass"], abs=1e-6)
    assert mass.text_content() == f"{answer['label_mass']:.4f}"

    page.click("#replay")
    expect(page.locator(".verdict")).to_have_attribute("data-match", "true")
    expect(page.locator("#replay-result tr")).to_have_count(1 + len(OPTIONS))
    screenshot(page, artifacts, "decision", capsys)


def test_metrics_panel_agrees_with_metrics(page, server: Server, artifacts: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    from playwright.sync_api import expect

    greedy_reply(server, [{"role": "user", "content": "Say hi."}])  # at least one TTFT and some ITLs
    server.wait_idle()
    m = server.scrape()
    ttft_n, itl_n = int(m["vllm:time_to_first_token_seconds_count"]), int(m["vllm:inter_token_latency_seconds_count"])
    expect(page.locator("#m-ttft-n")).to_have_text(f"{ttft_n} request{'s' * (ttft_n != 1)}")
    expect(page.locator("#m-itl-n")).to_have_text(f"{itl_n} token{'s' * (itl_n != 1)}")
    for id_, histogram in (("#m-ttft", "time_to_first_token"), ("#m-itl", "inter_token_latency")):
        mean = m[f"vllm:{histogram}_seconds_sum"] / m[f"vllm:{histogram}_seconds_count"]
        assert float(page.locator(id_).get_attribute("data-value")) == pytest.approx(mean, rel=1e-9)
        assert page.locator(id_).text_content() == f"{1000 * mean:.1f} ms"
    expect(page.locator("#m-running")).to_have_text("0")
    expect(page.locator("#m-waiting")).to_have_text("0")
    expect(page.locator("#m-kv")).to_have_text(f"{100 * m['vllm:kv_cache_usage_perc']:.1f}%")
    expect(page.locator("#m-tps")).to_have_text(re.compile(r"^\d+\.\d$"))  # tokens/s between two polls
    screenshot(page, artifacts, "metrics", capsys)


def test_page_works_under_root_path(browser, server: Server) -> None:
    """Every URL the page uses is relative, so behind a proxy prefix it calls the API under that prefix;
    the key typed in goes with each call."""
    from playwright.sync_api import expect

    thread = ServerThread(create_app(server.engine, MODEL, api_key=KEY, root_path="/llm")).start()
    try:
        page = open_page(browser, f"{thread.url}/llm/", key=KEY, only_under="/llm/")
        expect(page.locator("#m-running")).to_have_text("0")
        assert not page.errors, page.errors
        page.close()
    finally:
        thread.stop()


def parse(*argv: str) -> argparse.Namespace:
    return subcommand_parser("serve").parse_args(list(argv))


def test_webui_is_on_by_default_and_no_webui_turns_it_off(server: Server) -> None:
    assert serve_cli.app_options(parse())["webui"] is True
    assert serve_cli.app_options(parse("--no-webui"))["webui"] is False
    for webui in (True, False):
        thread = ServerThread(create_app(server.engine, MODEL, api_key=KEY, webui=webui)).start()
        try:
            check_page_served(thread.url) if webui else check_page_absent(thread.url)
        finally:
            thread.stop()


def check_page_served(url: str) -> None:
    """The page and its files need no API key; the API still does."""
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="webui/app.js"' in page.text
    assert httpx.get(f"{url}/webui/app.js").headers["content-type"].startswith("text/javascript")
    assert httpx.get(f"{url}/webui/style.css").headers["content-type"].startswith("text/css")
    assert httpx.get(f"{url}/webui/__init__.py").status_code == 404  # only the page's own files
    assert httpx.get(f"{url}/v1/models").status_code == 401
    paths = httpx.get(f"{url}/openapi.json").json()["paths"]
    assert "/" not in paths and not any(p.startswith("/webui") for p in paths)


def check_page_absent(url: str) -> None:
    assert httpx.get(f"{url}/").status_code == 404
    assert httpx.get(f"{url}/webui/app.js").status_code == 404
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
