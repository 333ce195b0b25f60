"""The API's docs (`/docs`, Swagger UI; `/redoc`) are served whole by the service: they render on a
machine without a network, and the browser that opens them asks nothing of another host."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from fastapi.testclient import TestClient

from densekit.retrieval.retriever import Retriever
from densekit.serving.app import create_app

from .service_fixtures import TOKEN, client, headless_chromium, in_thread

# What a page holds itself, and the browser's own pages (its new tab), never fetched from a host.
_LOCAL_SCHEMES = {"data", "blob", "about", "chrome", "chrome-untrusted"}


def _urls_in(html: str) -> list[str]:
    return re.findall(r"""(?:src|href|url)\s*[=:(]\s*['"]?([^'")\s>]+)""", html)


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_name_only_the_services_own_files(retriever: Retriever, page: str):
    service = client(retriever)
    html = service.get(page).text
    urls = _urls_in(html)
    assert urls, html
    for url in urls:
        assert not urlsplit(url).netloc, f"{page} loads {url} from elsewhere"
        response = service.get(url)  # without the token, as a browser opening the page asks
        assert response.status_code == 200, (url, response.text[:200])
        assert len(response.content) > 0


def test_the_docs_keep_the_services_host_check(retriever: Retriever):
    with TestClient(create_app(retriever, TOKEN, allowed_hosts=[])) as checked:  # as `serve` makes it
        local = {"Host": "127.0.0.1:8000"}
        asset = _urls_in(checked.get("/docs", headers=local).text)[0]
        for path in ("/docs", "/openapi.json", asset):
            assert checked.get(path, headers={"Host": "rebound.example.com"}).status_code == 403, path
            assert checked.get(path, headers=local).status_code == 200, path


def _requested(browser) -> list[str]:
    """The URLs of every request the browser sent, from its performance log."""
    messages = (json.loads(entry["message"])["message"] for entry in browser.get_log("performance"))
    return [m["params"]["request"]["url"] for m in messages if m["method"] == "Network.requestWillBeSent"]


@pytest.mark.browser
def test_the_docs_render_offline_and_ask_no_other_host(retriever: Retriever, tmp_path: Path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions
    from selenium.webdriver.support.ui import WebDriverWait

    no_other_host = "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"  # resolves 127.0.0.1 alone
    browser = headless_chromium(tmp_path / "profile", no_other_host, log_requests=True)
    try:
        with in_thread(create_app(retriever, TOKEN, allowed_hosts=[])) as url:
            _requested(browser)  # read (and so cleared): what the browser asked for before the page
            browser.get(url + "/docs")
            operation = (By.CSS_SELECTOR, ".opblock-summary-path[data-path='/search']")
            shown = expected_conditions.presence_of_element_located(operation)
            found = WebDriverWait(browser, 20).until(shown)
            assert "/search" in found.text
            requested = _requested(browser)
    finally:
        browser.quit()
    assert any(u.endswith("/openapi.json") for u in requested), requested  # the UI read the API's description
    elsewhere = [u for u in requested if urlsplit(u).scheme not in _LOCAL_SCHEMES
                 and urlsplit(u).hostname != "127.0.0.1"]  # fmt: skip
    assert elsewhere == [], elsewhere


def test_the_api_description_is_made_without_a_warning_and_health_answers_get_and_head(retriever: Retriever):
    app = create_app(retriever, TOKEN)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of an operation id given twice
        schema = app.openapi()
    assert list(schema["paths"]["/health"]) == ["get"]
    with TestClient(app) as http:
        assert http.get("/health").json() == {"status": "ok"}
        assert http.head("/health").status_code == 200
