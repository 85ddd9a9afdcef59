"""The status page in a real headless Chromium (Debian's ``chromium``, driven by
Playwright, never downloaded): against a real router and a real vLLM worker, Load makes
the model ``ready`` on the page, the playground streams an answer with its TTFT (and the
usage panel shows the request), Unload makes it ``unloaded``, and nothing is logged to
the console as an error. A screenshot is
kept in ``tests/artifacts/status-page.png``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import sync_playwright

from tests.conftest import ROOT, RouterProcess, router_with_runtime

pytestmark = pytest.mark.integration

CHROMIUM = "/usr/bin/chromium"
# Without these, Chromium on a machine with no network and no display misbehaves.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
ARTIFACT = ROOT / "tests" / "artifacts" / "status-page.png"

PAGE_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  runtime_dir: {runtime}
  load_timeout: 600
models:
  page-model:
    model: "builtin:smollm2"
    aliases: [smol-page]
    cpu_cores: "0"
    max_model_len: 512
  page-other: {model: "builtin:smollm2", max_model_len: 512}
"""


@pytest.fixture(scope="module")
def page_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with router_with_runtime(PAGE_PRESET, tmp_path_factory.mktemp("page"), "page") as r:
        yield r


def test_the_status_page_loads_chats_and_unloads_a_model(page_router: RouterProcess) -> None:
    assert Path(CHROMIUM).exists(), "chromium is listed in system-packages.txt"
    r = page_router
    problems: list[str] = []
    requests_outside: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1100})
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
                    if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
            page.on("request", lambda req: None if req.url.startswith(r.url)
                    or req.url.startswith("data:") else requests_outside.append(req.url))
            page.goto(r.url + "/")
            row = 'tr[data-model="page-model"]'
            page.wait_for_selector(f'{row}[data-state="unloaded"]', timeout=15_000)
            assert page.text_content("#conn") == "events: live"
            assert "smol-page" in (page.text_content(f"{row} .aliases") or "")
            assert page.locator('tr[data-model="page-other"]').count() == 1

            page.click(f'{row} button[data-action="load"]')
            page.wait_for_selector(f'{row}[data-state="ready"]', timeout=300_000)
            model = r.client.get(f"{r.url}/v1/models/page-model").json()
            assert page.text_content(f"{row} .pid") == str(model["pid"])
            assert "VLLM_CPU_OMP_THREADS_BIND=0" in (page.text_content(f"{row} .placement")
                                                    or "")
            # The load's phases arrive with its "load" event, once the engine's are read.
            page.wait_for_function(
                "document.querySelector('tr[data-model=\"page-model\"] .phases')"
                ".textContent.includes('engine')", timeout=10_000)
            assert page.locator(f"{row} .bar span").count() >= 3
            assert page.locator("#events li[data-type='load']").count() == 1

            page.fill("#chat-model", "smol-page")  # an alias: any name the router resolves
            page.fill("#chat-prompt", "Write one sentence about the sea.")
            page.fill("#chat-max", "24")
            page.click("#chat-send")
            page.wait_for_function(
                "document.getElementById('chat-output').textContent.length > 0",
                timeout=120_000)
            page.wait_for_function(
                "document.getElementById('chat-status').textContent.startsWith('done')",
                timeout=120_000)
            assert page.text_content("#chat-ttft").startswith("TTFT ")  # type: ignore[union-attr]
            ttft_ms = int(page.text_content("#chat-ttft").split()[1])  # type: ignore[union-attr]
            assert 0 < ttft_ms < 60_000
            assert page.text_content("#chat-tps").endswith(" tokens/s")  # type: ignore[union-attr]
            assert float(page.text_content("#chat-tps").split()[0]) > 0  # type: ignore[union-attr]
            # The request's summary reaches the request log and the model's row.
            request = page.locator('#requests tbody tr[data-status="200"]')
            request.first.wait_for(timeout=10_000)
            assert "page-model" in (request.first.text_content() or "")
            assert page.text_content(f"{row} .tps") != "–"
            # The usage panel: the ledger's row for the model, a second or so later.
            usage = page.locator('#usage tbody tr[data-model="page-model"]')
            usage.wait_for(timeout=15_000)
            cells = usage.locator("td").all_text_contents()
            assert cells[0] == "(no key)" and int(cells[2]) >= 1 and int(cells[5]) >= 1
            # The worker log streams (the model has been loaded, so its log has lines).
            page.select_option("#log-model", "page-model")
            page.wait_for_function(
                "document.getElementById('log').textContent.includes('INFO')", timeout=15_000)

            ARTIFACT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACT), full_page=True)

            page.click(f'{row} button[data-action="unload"]')
            page.wait_for_selector(f'{row}[data-state="unloaded"]', timeout=60_000)
            assert page.text_content(f"{row} .pid") == "–"
            assert r.client.get(f"{r.url}/v1/models/page-model").json()["state"] == "unloaded"
        finally:
            browser.close()
    assert not problems, problems
    assert not requests_outside, requests_outside
