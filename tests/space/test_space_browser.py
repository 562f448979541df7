"""The Space in headless chromium (`LMLP_CHROMIUM`, else `chromium` on the PATH) driven by Playwright, on 127.0.0.1;
skipped without them unless `LMLP_REQUIRE_BROWSER=1`. The screenshot goes to `LMLP_TEST_ARTIFACTS`, else tmp_path."""

import importlib.util
import io
import os
import shutil
import threading
from pathlib import Path

import pytest
from PIL import Image
from space_server import emoji_pipeline, image_std, load_app, serve


# Without the background-networking flags chromium waits on connections that cannot be made here.
CHROMIUM_ARGS = (
    "--headless --no-sandbox --disable-gpu --disable-quic --no-first-run --disable-background-networking "
    "--disable-component-update --disable-sync"
).split()
TIMEOUT_MS = 60_000  # for any one browser action or wait


def chromium_or_skip() -> str:
    """The chromium binary to drive; skips the test (fails it under `LMLP_REQUIRE_BROWSER=1`) without one."""
    chromium = os.environ.get("LMLP_CHROMIUM") or shutil.which("chromium")
    if importlib.util.find_spec("playwright") is None:
        reason = "the playwright Python package is not installed (pip install playwright)"
    elif chromium is None or not os.access(chromium, os.X_OK):
        reason = "no chromium binary (apt-get install chromium, or set LMLP_CHROMIUM to one)"
    else:
        return chromium
    if os.environ.get("LMLP_REQUIRE_BROWSER") == "1":
        pytest.fail(f"LMLP_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def page(shapes_pipe):
    """The app as it serves the shipped models: the emoji world's first, the shapes world's beside it."""
    chromium = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    demo = load_app().build_demo({"emoji": emoji_pipeline(), "shapes": shapes_pipe}, queue_size=8)
    with serve(demo) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.set_default_timeout(TIMEOUT_MS)
            page.goto(url)
            page.wait_for_selector("#prompt textarea")
            yield page
        finally:
            browser.close()


def gallery_images(page, old: tuple[str, ...] = ()) -> list[dict]:
    """The gallery's 4 images once loaded (none of them `old`), with their natural size, shown width and rendering."""
    page.wait_for_function(
        "old => { const imgs = [...document.querySelectorAll('#gallery img')];"
        " return imgs.length === 4 && imgs.every(img => img.complete && !old.includes(img.src)); }",
        arg=list(old),
    )
    shown = page.eval_on_selector_all(
        "#gallery img",
        "imgs => imgs.map(img => ({src: img.src, natural: [img.naturalWidth, img.naturalHeight], "
        "width: img.getBoundingClientRect().width, rendering: getComputedStyle(img).imageRendering}))",
    )
    for img in shown:
        response = page.request.get(img["src"])
        image = Image.open(io.BytesIO(response.body()))
        assert response.ok and img["natural"] == [32, 32], "the gallery must show the model's native pixels"
        assert image.format == "PNG" and image.size == (32, 32) and image_std(image) > 8, "the image is blank"
    return shown


@pytest.mark.slow
def test_browser_draws_emoji_refuses_bad_input_and_shows_progress_and_crisp_shapes(page, shapes_pipe, tmp_path):
    panel = page.inner_text("#model-info")  # it opens on the emoji model, with its examples
    assert "emoji world" in panel and "UL-MLP" in panel
    assert page.get_by_text("a small blue square at the top left", exact=True).count() == 0  # the shapes examples
    page.get_by_text("red apple", exact=True).click()
    page.wait_for_function("document.querySelector('#prompt textarea').value === 'red apple'")
    page.click("#generate")
    emoji = tuple(img["src"] for img in gallery_images(page))
    page.locator("#model label", has_text="shapes").click()
    page.wait_for_function("document.querySelector('#model-info').innerText.includes('shapes world')")
    page.get_by_text("a small blue square at the top left", exact=True).click()
    page.wait_for_function(
        "document.querySelector('#prompt textarea').value === 'a small blue square at the top left'"
    )
    page.fill("#prompt textarea", "   ")
    page.click("#generate")
    page.get_by_text("The prompt is empty").wait_for()
    assert "Traceback" not in page.content()
    # Test-only hold: the 10th forward pass (step 10 of 50) waits until the page has shown the progress so far.
    calls, gate = [], threading.Event()

    def hold(module, args):
        calls.append(None)
        if len(calls) == 10:
            gate.wait(TIMEOUT_MS / 1000)

    hook = shapes_pipe.transformer.register_forward_pre_hook(hold)
    try:
        page.fill("#prompt textarea", "a large red circle at the center")
        page.click("#generate")
        page.get_by_text("9/50 steps").wait_for()  # the progress bar, driven by callback_on_step_end
        assert "Denoising" in page.inner_text("#gallery")
        gate.set()
        for img in gallery_images(page, old=emoji):  # the default number of images
            assert img["width"] >= 128 and img["rendering"] == "pixelated", "32×32 images must be shown large, crisp"
    finally:
        gate.set()
        hook.remove()
    panel = page.inner_text("#model-info")
    assert "UL-MLP" in panel and "866,626 parameters" in panel and "shapes world" in panel
    screenshot = Path(os.environ.get("LMLP_TEST_ARTIFACTS") or tmp_path) / "space.png"
    page.screenshot(path=screenshot, full_page=True)
    assert screenshot.stat().st_size > 0
