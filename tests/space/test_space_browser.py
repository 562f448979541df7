"""The Space in a real browser: headless Debian chromium, driven by Playwright, against the app on 127.0.0.1.

Needs the `playwright` Python package and a chromium binary (`LMLP_CHROMIUM`, else `chromium` on the PATH; Debian's
`apt-get install chromium`; Playwright's own browser download is not used). Without them the tests skip, unless
`LMLP_REQUIRE_BROWSER=1` (set by CI), where they fail. The screenshot goes to `LMLP_TEST_ARTIFACTS` when set, else
to the test's pytest temporary folder.
"""

import io
import os
import shutil
import threading
from pathlib import Path

import pytest
from PIL import Image
from space_server import emoji_pipeline, image_std, load_app, one_cpu_thread, serve


# Without the background-networking flags chromium waits on connections that cannot be made here.
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 60_000  # for any one browser action or wait


def chromium_or_skip() -> str:
    """The chromium binary to drive; skips the test (fails it under `LMLP_REQUIRE_BROWSER=1`) without one."""
    reason = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        reason = "the playwright Python package is not installed (pip install playwright)"
    chromium = os.environ.get("LMLP_CHROMIUM") or shutil.which("chromium")
    if reason is None and (chromium is None or not os.access(chromium, os.X_OK)):
        reason = "no chromium binary (apt-get install chromium, or set LMLP_CHROMIUM to one)"
    if reason is None:
        return chromium
    if os.environ.get("LMLP_REQUIRE_BROWSER") == "1":
        pytest.fail(f"LMLP_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(reason)


@pytest.fixture
def artifacts(tmp_path) -> Path:
    folder = Path(os.environ.get("LMLP_TEST_ARTIFACTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def emoji_pipe():
    with one_cpu_thread():
        yield emoji_pipeline()


@pytest.fixture
def page(emoji_pipe, shapes_pipe):
    """The app as it serves the shipped models: the emoji world's first, the shapes world's beside it."""
    chromium = chromium_or_skip()
    from playwright.sync_api import sync_playwright

    demo = load_app().build_demo({"emoji": emoji_pipe, "shapes": shapes_pipe}, queue_size=8)
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


def choose(page, model: str) -> None:
    """Pick a model in the app's model choice and wait for its panel."""
    page.locator("#model label", has_text=model).click()
    page.wait_for_function(f"document.querySelector('#model-info').innerText.includes('{model} world')")


def gallery_images(page) -> list[dict]:
    """The gallery's images once all 4 have loaded: their source, natural size, shown width and rendering."""
    page.wait_for_selector("#gallery img")
    page.wait_for_function(
        "document.querySelectorAll('#gallery img').length === 4 && [...document.querySelectorAll('#gallery img')].every(img => img.complete)"
    )
    return page.eval_on_selector_all(
        "#gallery img",
        "imgs => imgs.map(img => ({src: img.src, natural: [img.naturalWidth, img.naturalHeight], "
        "width: img.getBoundingClientRect().width, rendering: getComputedStyle(img).imageRendering}))",
    )


@pytest.mark.slow
def test_browser_opens_on_the_emoji_model_and_draws_an_emoji_from_its_examples(page, artifacts):
    panel = page.inner_text("#model-info")
    assert "emoji world" in panel and "UL-MLP" in panel
    page.get_by_text("red apple", exact=True).click()
    page.wait_for_function("document.querySelector('#prompt textarea').value === 'red apple'")
    page.click("#generate")
    shown = gallery_images(page)
    assert [img["natural"] for img in shown] == [[32, 32]] * 4
    for img in shown:
        image = Image.open(io.BytesIO(page.request.get(img["src"]).body()))
        assert image.format == "PNG" and image_std(image) > 8, "the image is blank"
    page.screenshot(path=artifacts / "space-emoji.png", full_page=True)


@pytest.mark.slow
def test_browser_generates_native_images_shown_large_and_crisp(page, artifacts):
    choose(page, "shapes")
    page.fill("#prompt textarea", "a large red circle at the center")
    page.click("#generate")
    shown = gallery_images(page)
    assert len(shown) == 4  # the default number of images
    for img in shown:
        assert img["natural"] == [32, 32], "the gallery must show the model's native pixels"
        assert img["width"] >= 128, "the 32×32 images must be shown large"
        assert img["rendering"] == "pixelated"
        response = page.request.get(img["src"])
        assert response.ok
        image = Image.open(io.BytesIO(response.body()))
        assert image.format == "PNG" and image.size == (32, 32)
        assert image_std(image) > 8, "the image is blank"

    panel = page.inner_text("#model-info")
    assert "UL-MLP" in panel and "866,626 parameters" in panel and "shapes world" in panel
    page.screenshot(path=artifacts / "space.png", full_page=True)
    assert (artifacts / "space.png").stat().st_size > 0


@pytest.mark.slow
def test_browser_examples_fill_the_prompt_and_bad_input_shows_the_message(page):
    assert page.get_by_text("a small blue square at the top left", exact=True).count() == 0  # the emoji examples
    choose(page, "shapes")
    page.get_by_text("a small blue square at the top left", exact=True).click()
    page.wait_for_function(
        "document.querySelector('#prompt textarea').value === 'a small blue square at the top left'"
    )

    page.fill("#prompt textarea", "   ")
    page.click("#generate")
    page.get_by_text("The prompt is empty").wait_for()
    assert "Traceback" not in page.content()


@pytest.mark.slow
def test_browser_shows_live_progress_while_denoising(page, shapes_pipe):
    # Test-only hold: the 10th forward pass (step 10 of 50) waits until the page has shown the progress so far.
    calls, gate = [], threading.Event()

    def hold(module, args):
        calls.append(None)
        if len(calls) == 10:
            gate.wait(TIMEOUT_MS / 1000)

    hook = shapes_pipe.transformer.register_forward_pre_hook(hold)
    try:
        choose(page, "shapes")
        page.fill("#prompt textarea", "a small blue square at the top left")
        page.click("#generate")
        page.get_by_text("9/50 steps").wait_for()  # the progress bar, driven by callback_on_step_end
        assert "Denoising" in page.inner_text("#gallery")
        gate.set()
        page.wait_for_function("document.querySelectorAll('#gallery img').length === 4")
    finally:
        gate.set()
        hook.remove()
