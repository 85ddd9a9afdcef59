"""The status page in a real headless Chromium (Debian's ``chromium``, driven by
Playwright, never downloaded): against a real router and a real vLLM worker, Load makes
the model ``ready`` on the page, the playground streams an answer with its TTFT (and the
usage panel shows the request), Unload makes it ``unloaded``, and nothing is logged to
the console as an error. A screenshot is
kept in ``tests/artifacts/status-page.png``.

Against a router with a synthetic base and a LoRA adapter model (no vLLM), the adapter's
row sits under its base's with its state in the base's engine and its rank; a chat with
the adapter makes it ``resident``, and its Unload and Load move it out of and into the
engine while the base serves on; an adapter found in the base's ``adapters_dir`` by a
chat gets its row under the base's (``tests/artifacts/status-page-adapters.png``). This
one is not ``integration``: it starts no vLLM.

Against a router with synthetic models and keys, the batches panel lists the page's key's
batches (not another key's): one made through the API reaches ``completed`` with its
progress; a slow one shows its progress, lines per second and ETA while it runs, and its
Cancel ends it ``cancelled`` (``tests/artifacts/status-page-batches.png``). No vLLM either.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, Page, Playwright, sync_playwright

from tests.conftest import ROOT, RouterProcess, router_with_runtime
from tests.test_batches import client, finished, line, upload

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


def open_page(p: Playwright, r: RouterProcess, problems: list[str],
              requests_outside: list[str], key: str = "") -> tuple[Browser, Page]:
    """Chromium on ``r``'s status page (with ``key`` as if typed in before it loaded);
    console errors and warnings, page errors and any request that leaves the router go
    into the lists."""
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    if key:
        page.add_init_script(f"sessionStorage.setItem('modelyard-api-key', {json.dumps(key)})")
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda err: problems.append(f"page error: {err}"))
    page.on("request", lambda req: None if req.url.startswith(r.url)
            or req.url.startswith("data:") else requests_outside.append(req.url))
    page.goto(r.url + "/")
    return browser, page


@pytest.fixture(scope="module")
def page_router(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RouterProcess]:
    with router_with_runtime(PAGE_PRESET, tmp_path_factory.mktemp("page"), "page") as r:
        yield r


@pytest.mark.integration
def test_the_status_page_loads_chats_and_unloads_a_model(page_router: RouterProcess) -> None:
    assert Path(CHROMIUM).exists(), "chromium is listed in system-packages.txt"
    r = page_router
    problems: list[str] = []
    requests_outside: list[str] = []
    with sync_playwright() as p:
        browser, page = open_page(p, r, problems, requests_outside)
        try:
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


ADAPTER_PRESET = """
server: {host: 127.0.0.1, port: {port}, runtime_dir: {runtime}, spare_workers: 0}
models:
  page-base: {model: /synthetic, engine: synthetic, max_model_len: 4096, adapters_dir: found}
  page-lora: {base: page-base, adapter: lora}
"""


def test_the_status_page_lists_an_adapter_under_its_base(tmp_path: Path) -> None:
    assert Path(CHROMIUM).exists(), "chromium is listed in system-packages.txt"
    for folder in (tmp_path / "lora", tmp_path / "found" / "extra"):  # beside the preset
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}))
        (folder / "adapter_model.safetensors").write_bytes(b"")
    problems: list[str] = []
    requests_outside: list[str] = []
    base, lora = 'tr[data-model="page-base"]', 'tr[data-model="page-lora"]'
    with router_with_runtime(ADAPTER_PRESET, tmp_path, "page-lora") as r, \
            sync_playwright() as p:
        browser, page = open_page(p, r, problems, requests_outside)
        try:
            page.wait_for_selector(f'{base}[data-state="unloaded"]', timeout=15_000)
            page.wait_for_selector(f'{lora}[data-parent="page-base"][data-state="known"]',
                                   timeout=15_000)
            assert page.evaluate(  # the row right under its base's
                f"document.querySelector('{base}').nextElementSibling.dataset.model") == \
                "page-lora"
            assert (page.text_content(f"{lora} td.id") or "").startswith("↳ page-lora")
            assert page.text_content(f"{lora} .adapter-about") == "rank 8"
            assert page.text_content(f"{lora} .placement") == "LoRA on page-base"
            assert page.locator("#log-model option").all_text_contents() == ["page-base"]

            # A chat with the adapter starts its base and loads the adapter into its engine.
            page.fill("#chat-model", "page-lora")
            page.fill("#chat-max", "3")
            page.click("#chat-send")
            page.wait_for_function(
                "document.getElementById('chat-status').textContent.startsWith('done')",
                timeout=60_000)
            assert "page-lora" in (page.text_content("#chat-output") or "")
            page.wait_for_selector(f'{base}[data-state="ready"]', timeout=10_000)
            page.wait_for_selector(f'{lora}[data-state="resident"]', timeout=10_000)
            assert "1 load" in (page.text_content(f"{lora} .load") or "")

            ARTIFACT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACT.with_name("status-page-adapters.png")),
                            full_page=True)

            # Its Unload drops it from the base's engine; the base serves on.
            page.click(f'{lora} button[data-action="unload"]')
            page.wait_for_selector(f'{lora}[data-state="known"]', timeout=10_000)
            assert page.get_attribute(base, "data-state") == "ready"
            assert r.client.get(f"{r.url}/v1/models/page-base").json()["state"] == "ready"
            # Its Load puts it back (a second load in this engine).
            page.click(f'{lora} button[data-action="load"]')
            page.wait_for_selector(f'{lora}[data-state="resident"]', timeout=10_000)
            assert "2 loads" in (page.text_content(f"{lora} .load") or "")
            assert page.get_attribute(base, "data-state") == "ready"
            assert r.client.get(f"{r.url}/v1/models/page-base").json()["state"] == "ready"

            # An adapter found in the base's adapters_dir by its first request gets its row
            # under its base's once it has served.
            assert page.locator('tr[data-model="page-base/extra"]').count() == 0
            page.fill("#chat-model", "page-base/extra")
            page.click("#chat-send")
            page.wait_for_function(
                "document.getElementById('chat-output').textContent.includes('page-base/extra')",
                timeout=30_000)
            found = 'tr[data-model="page-base/extra"][data-parent="page-base"]'
            page.wait_for_selector(found, timeout=10_000)
            assert page.evaluate(
                f"document.querySelector('{lora}').nextElementSibling.dataset.model") == \
                "page-base/extra"
            assert "found in adapters_dir" in (page.text_content(f"{found} .adapter-about")
                                               or "")
        finally:
            browser.close()
    assert not problems, problems
    assert not requests_outside, requests_outside


ALICE, BOB = "k-page-alice-1a", "k-page-bob-2b"
BATCH_PRESET = """
server:
  host: 127.0.0.1
  port: {port}
  runtime_dir: {runtime}
  cache_dir: {cache}
  spare_workers: 0
  api_keys: [k-page-alice-1a, k-page-bob-2b]
  admin_api_keys: [k-page-admin-3c]
  batch_model_concurrency: 2
models:
  page-fast: {model: /synthetic, engine: synthetic}
  page-slow: {model: /synthetic, engine: synthetic, engine_args: {tokens_per_second: 10}}
"""


def test_the_status_page_shows_batches_progress_and_cancels_one(tmp_path: Path) -> None:
    assert Path(CHROMIUM).exists(), "chromium is listed in system-packages.txt"
    problems: list[str] = []
    requests_outside: list[str] = []
    preset = BATCH_PRESET.replace("{cache}", str(tmp_path / "cache"))
    with router_with_runtime(preset, tmp_path, "page-batch") as r, sync_playwright() as p:
        alice, bob = client(r, ALICE), client(r, BOB)
        theirs = bob.batches.create(input_file_id=upload(bob, [line("b", model="page-fast")]),
                                    endpoint="/v1/chat/completions", completion_window="24h")
        browser, page = open_page(p, r, problems, requests_outside, key=ALICE)
        refused: list[str] = []
        page.on("response", lambda got: refused.append(got.url) if got.status >= 400 else None)
        try:
            page.wait_for_selector("#conn.conn-on", timeout=15_000)
            quick = alice.batches.create(
                input_file_id=upload(alice, [line(f"q-{i}", model="page-fast")
                                             for i in range(4)]),
                endpoint="/v1/chat/completions", completion_window="24h")
            row = f'tr[data-batch="{quick.id}"]'
            page.wait_for_selector(f'{row}[data-status="completed"]', timeout=30_000)
            assert page.text_content(f"{row} .progress") == "4/4"
            assert page.text_content(f"{row} .failed") == "0"
            assert page.get_attribute(f"{row} .bar .ok", "style") == "width: 100%;"
            assert page.locator(f'{row} button[data-action="cancel"]').count() == 0

            slow = alice.batches.create(
                input_file_id=upload(alice, [line(f"s-{i}", model="page-slow", max_tokens=20)
                                             for i in range(6)]),
                endpoint="/v1/chat/completions", completion_window="24h")
            row = f'tr[data-batch="{slow.id}"]'
            # 2 lines at once, 2 s each: the first two end, and a progress event tells it
            page.wait_for_function(
                f"(document.querySelector('{row}[data-status=\"in_progress\"] .progress') "
                "|| {textContent: '0/'}).textContent.startsWith('0/') === false",
                timeout=30_000)
            assert page.text_content(f"{row} .rate") != "–"
            assert page.text_content(f"{row} .eta") != "–"
            assert page.locator("#events li[data-type='batch']").count() >= 3
            ARTIFACT.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACT.with_name("status-page-batches.png")),
                            full_page=True)

            page.click(f'{row} button[data-action="cancel"]')
            page.wait_for_selector(f'{row}[data-status="cancelled"]', timeout=30_000)
            assert page.text_content(f"{row} .progress") == "6/6"  # the rest: cancelled
            assert int(page.text_content(f"{row} .failed") or 0) >= 1
            done = finished(alice, slow.id)
            assert done.status == "cancelled" and done.request_counts.completed < 6, done
            assert page.locator(f'tr[data-batch="{theirs.id}"]').count() == 0  # Bob's
            assert page.locator("#batches tbody tr").count() == 2
        finally:
            browser.close()
    # A user key may not read worker logs (an admin's): the log panel's 403s, and only
    # those, are expected.
    assert refused and all("/logs?" in url for url in refused), refused
    problems = [text for text in problems if "status of 403 (Forbidden)" not in text]
    assert not problems, problems
    assert not requests_outside, requests_outside
