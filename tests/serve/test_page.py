"""The web page at ``/`` in a real headless Chromium (Debian's ``chromium`` and ``chromium-driver``, driven through
Selenium) against ``fastwan serve --model tiny`` on loopback: the key entered once, a video made from the form
(queued behind a running one, its progress bar run to the end), its mp4 played in the gallery, deleted with its
button; a wrong key shows the server's 401 message and the key is asked for again; an API error under the form;
the page's files served without the key, with their security headers. The server: tests/serve/conftest.py."""
from __future__ import annotations

import io
import urllib.request
import uuid
from pathlib import Path

import imageio.v3 as iio
import numpy as np
import pytest
from PIL import Image

from tests.serve.helpers import KEY, call, nearest_4k_plus_1, wait, wait_started

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # openai marks its Videos API deprecated
CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
TIMEOUT = 90.0  # seconds for any one thing the page is waited on to do (2 busy cores)
TINY_FPS = 8  # the tiny checkpoints' preset fps (docs/models.md)
CARD = """const card = document.querySelector(`article[data-id="${arguments[0]}"]`);
if (!card) return null;
const video = card.querySelector("video");
return {box: card.parentElement.id, status: card.dataset.status, progress: card.querySelector("progress").value,
        ready: video && video.readyState, duration: video && video.duration, src: video && video.src,
        width: video && video.videoWidth, height: video && video.videoHeight};"""
PLAY = """const [id, done] = arguments;
const video = document.querySelector(`article[data-id="${id}"] video`);
video.addEventListener("timeupdate", () => { if (video.currentTime > 0) done(video.currentTime); });
video.play().catch((err) => done(String(err)));"""


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    if not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.skip(f"the page's test needs Debian's packages chromium and chromium-driver ({CHROMIUM}, "
                    f"{CHROMEDRIVER}); install them with apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    tmp = tmp_path_factory.mktemp("chromium")
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # the console, read by the flow's test
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                f"--user-data-dir={tmp / 'profile'}"):  # --no-sandbox: Chromium refuses to run as root without it
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(str(CHROMEDRIVER), log_output=str(tmp / "driver.log")))
    driver.set_page_load_timeout(30)
    driver.set_script_timeout(30)
    yield driver
    driver.quit()


def until(driver, check, what: str, timeout: float = TIMEOUT):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: check(), message=what)


def visible(driver, element_id: str) -> bool:
    return driver.execute_script("const e = document.getElementById(arguments[0]); return !!e && !e.hidden && "
                                 "e.offsetParent !== null;", element_id)


def open_page(driver, url: str, key: str | None) -> None:
    """The page, as a browser that never saw it (no key kept) opens it; ``key`` entered in its key form."""
    from selenium.webdriver.common.by import By

    driver.get(url + "/")
    driver.execute_script("localStorage.clear();")
    driver.get(url + "/")
    until(driver, lambda: visible(driver, "key-input"), "the key form")
    assert not visible(driver, "app")
    if key is not None:
        driver.find_element(By.ID, "key-input").send_keys(key)
        driver.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()


def fill(driver, **fields: str) -> None:
    from selenium.webdriver.common.by import By

    for name, value in fields.items():
        box = driver.find_element(By.CSS_SELECTOR, f"#create-form [name={name}]")
        box.clear()
        box.send_keys(value)


def listed(server, prompt: str) -> list[dict]:
    status, body = call("GET", f"{server.url}/v1/videos?limit=100")
    assert status == 200, body
    return [v for v in body["data"] if v["prompt"] == prompt]


def test_create_watch_play_and_delete_from_the_page(server, browser):
    from selenium.webdriver.common.by import By

    client = server.client()
    blocker = client.videos.create(prompt="runs while the page's video waits", size="128x128", seconds="1",
                                   extra_body={"num_inference_steps": 333})  # a minute on 2 cores; deleted below
    wait_started(client, blocker.id)
    open_page(browser, server.url, KEY)
    until(browser, lambda: visible(browser, "app"), "the page after the key")
    until(browser, lambda: (browser.execute_script(CARD, blocker.id) or {}).get("progress", 0) >= 1,
          "the running video's progress bar moving")
    shown = browser.execute_script(CARD, blocker.id)
    assert (shown["box"], shown["status"]) == ("queue", "in_progress")
    assert shown["progress"] <= client.videos.retrieve(blocker.id).progress

    prompt = f"a paper boat on a pond {uuid.uuid4().hex[:8]}"
    fields = {"negative_prompt": "blurry", "size": "32x32", "seconds": "0.5", "num_inference_steps": "2",
              "seed": "7"}
    fill(browser, prompt=prompt, **fields)
    browser.find_element(By.ID, "create-button").click()
    until(browser, lambda: listed(server, prompt), "the server to list the page's video")
    [video] = listed(server, prompt)
    assert (video["size"], video["seconds"], video["status"]) == ("32x32", "0.5", "queued")
    until(browser, lambda: browser.execute_script(CARD, video["id"]) is not None, "the queued video's card")
    assert browser.execute_script(CARD, video["id"])["box"] == "queue"

    client.videos.delete(blocker.id)  # the page's video starts now
    until(browser, lambda: browser.execute_script(CARD, blocker.id) is None, "the deleted video's card to go")
    until(browser, lambda: browser.execute_script(CARD, video["id"])["progress"] == 100, "the progress bar's end")
    until(browser, lambda: (browser.execute_script(CARD, video["id"])["ready"] or 0) >= 2, "the video to load")
    played = browser.execute_script(CARD, video["id"])
    assert (played["box"], played["status"]) == ("gallery", "completed")
    assert played["src"].startswith("blob:") and (played["width"], played["height"]) == (32, 32)
    assert played["duration"] == pytest.approx(nearest_4k_plus_1(0.5 * TINY_FPS) / TINY_FPS, abs=0.5 / TINY_FPS)
    assert browser.execute_async_script(PLAY, video["id"]) > 0  # it plays: its clock moves

    # the page sent every field: the same request through the API makes the same frames
    reference = client.videos.create(prompt=prompt, size="32x32", seconds="0.5",
                                     extra_body={"negative_prompt": "blurry", "num_inference_steps": 2, "seed": 7})
    assert wait(client, reference.id).status == "completed"
    frames = [iio.imread(io.BytesIO(client.videos.download_content(i).read()), extension=".mp4")
              for i in (video["id"], reference.id)]
    assert np.array_equal(*frames)
    client.videos.delete(reference.id)

    browser.find_element(By.CSS_SELECTOR, f'article[data-id="{video["id"]}"] button.delete').click()
    until(browser, lambda: browser.execute_script(CARD, video["id"]) is None, "the card to go after its delete")
    assert not listed(server, prompt)
    assert call("GET", f"{server.url}/v1/videos/{video['id']}")[0] == 404
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors  # no script error, nothing the page's policy blocked


def test_the_page_plays_a_causal_video_while_it_is_made(causal_server, browser):
    """A tiny causal model's running video (21 chunks, the most its DiT holds) plays in its card from its stream
    before it is completed; then the card plays the finished file."""
    status, video = call("POST", f"{causal_server.url}/v1/videos", {"prompt": "a kite over dunes", "size": "64x64",
                                                                    "num_frames": 9 + 12 * 20, "seed": 3})
    assert status == 200, video
    try:
        open_page(browser, causal_server.url, KEY)
        until(browser, lambda: visible(browser, "app"), "the page after the key")
        until(browser, lambda: ((browser.execute_script(CARD, video["id"]) or {}).get("ready") or 0) >= 2,
              "the running video to play from its stream")
        shown = browser.execute_script(CARD, video["id"])
        assert browser.execute_async_script(PLAY, video["id"]) > 0  # it plays: its clock moves
        _, now = call("GET", f"{causal_server.url}/v1/videos/{video['id']}")
        assert now["status"] == "in_progress"  # all of the above before the video was completed
        assert (shown["box"], shown["status"]) == ("queue", "in_progress")
        assert shown["src"].startswith("blob:") and (shown["width"], shown["height"]) == (64, 64)

        # once it is completed, the card plays the finished file, the whole video, with its download link
        until(browser, lambda: browser.execute_script(CARD, video["id"])["box"] == "gallery", "the gallery")
        until(browser, lambda: browser.execute_script(
            f'return !!document.querySelector(`article[data-id="{video["id"]}"] a.download`);'), "the file's link")
        until(browser, lambda: (browser.execute_script(CARD, video["id"])["ready"] or 0) >= 2, "the file to load")
        played = browser.execute_script(CARD, video["id"])
        assert played["src"] != shown["src"] and played["src"].startswith("blob:")
        assert played["duration"] == pytest.approx((9 + 12 * 20) / TINY_FPS, abs=0.5 / TINY_FPS)
    finally:
        call("DELETE", f"{causal_server.url}/v1/videos/{video['id']}")
    until(browser, lambda: browser.execute_script(CARD, video["id"]) is None, "the deleted video's card to go")
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, errors


def test_a_wrong_key_shows_the_servers_message_and_asks_again(server, browser):
    status, body = call("GET", f"{server.url}/v1/videos", key="not-the-key")
    assert status == 401
    open_page(browser, server.url, "not-the-key")
    until(browser, lambda: browser.find_element("id", "key-error").text, "the 401 message")
    assert browser.find_element("id", "key-error").text == body["error"]["message"]
    assert visible(browser, "key-input") and not visible(browser, "app")
    assert browser.execute_script("return localStorage.getItem('fastwan.apiKey');") is None
    open_page(browser, server.url, KEY)
    until(browser, lambda: visible(browser, "app"), "the page after the right key")
    browser.refresh()  # the key is kept: no form this time
    until(browser, lambda: visible(browser, "app"), "the page after a reload")
    assert not visible(browser, "key-input")


def test_an_api_error_shows_under_the_form(server, browser, tmp_path):
    """An uploaded first frame on a text-to-video checkpoint: the server's 400, the message the API gives."""
    import openai
    from selenium.webdriver.common.by import By

    image = tmp_path / "first.png"
    Image.fromarray(np.zeros((32, 32, 3), np.uint8)).save(image)
    form = {"prompt": "a still lake", "size": "32x32"}
    with pytest.raises(openai.BadRequestError) as refused:
        server.client().videos.create(**form, input_reference=("first.png", image.read_bytes(), "image/png"))
    open_page(browser, server.url, KEY)
    until(browser, lambda: visible(browser, "app"), "the page after the key")
    fill(browser, **form)
    browser.find_element(By.CSS_SELECTOR, "#create-form [name=input_reference]").send_keys(str(image))
    browser.find_element(By.ID, "create-button").click()
    until(browser, lambda: browser.find_element(By.ID, "form-error").text, "the create's error")
    assert browser.find_element(By.ID, "form-error").text == refused.value.body["message"]
    assert not listed(server, "a still lake")


def test_the_page_files_need_no_key_and_carry_security_headers(server):
    for route, kind in (("/", "text/html"), ("/page.js", "text/javascript"), ("/page.css", "text/css")):
        with urllib.request.urlopen(server.url + route, timeout=30) as answer:  # no key
            assert answer.status == 200 and answer.read(), route
            headers = answer.headers
        assert headers["content-type"].startswith(kind)
        policy = dict(part.strip().split(" ", 1) for part in headers["content-security-policy"].split(";"))
        assert policy["default-src"] == "'none'" and policy["media-src"] == "blob:"
        assert policy["script-src"] == policy["connect-src"] == "'self'" and policy["frame-ancestors"] == "'none'"
        assert headers["x-content-type-options"] == "nosniff"
    assert call("GET", f"{server.url}/v1/videos", key=None)[0] == 401  # the API still needs the key
    assert call("GET", f"{server.url}/page.html", key=None)[0] == 404  # only the page's own files
