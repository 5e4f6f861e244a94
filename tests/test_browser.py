"""The HTML report in a real browser (the system's headless Chromium through Playwright): it loads offline with no
console error and no request leaving the file, shows the verdict and the critical layer, and draws a non-blank
page at desktop and phone widths without the page itself scrolling sideways.

Adding a page is one line in CASES: (example file, extra command-line arguments).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from conftest import EXAMPLES

CASES = [
    ("resnet18_w16.py", ()),
    ("fig2_e.py", ()),
    ("cnn6.py", ()),
    ("cnn6.py", ("--verify", "rgap", "--samples", "2", "--artifacts", "{tmp}/art")),  # {tmp}: the case's folder
]
VIEWPORTS = {"desktop": (1280, 900), "phone": (390, 844)}
SHOTS = Path("/tmp/rankaudit-shots")  # also kept here, to look at by eye


def _browser_or_skip():
    """The system Chromium (never `playwright install`, which downloads one); missing tools skip, except on CI."""
    missing = []
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
        missing.append("the playwright package (pip install playwright)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        missing.append("a chromium executable on PATH (apt-get install chromium)")
    if missing:
        reason = "browser test needs " + " and ".join(missing)
        if os.environ.get("CI") == "true":
            pytest.fail(reason + " (CI installs them)")
        pytest.skip(reason)
    return sync_playwright, chromium


@pytest.fixture(scope="module")
def browser():
    sync_playwright, chromium = _browser_or_skip()
    with sync_playwright() as playwright:
        instance = playwright.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield instance
        instance.close()


def _cli(*args: str) -> int:
    from rankaudit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([str(a) for a in args])
    return exit_info.value.code


def _without_verify(extra: tuple[str, ...]) -> list[str]:
    """The same analysis without running an attack: verification never changes the verdict or the critical layer.
    --artifacts goes too: it saves what an attack finds, so without --verify it is refused."""
    kept, skip = [], False
    for arg in extra:
        if skip:
            skip = False
        elif arg in ("--verify", "--artifacts"):
            skip = True
        elif not arg.startswith(("--verify=", "--artifacts=")):
            kept.append(arg)
    return kept


def _write_page(example: str, extra: tuple[str, ...], folder: Path, capsys) -> tuple[Path, dict]:
    """The page as the CLI writes it (`--format html`), and the Result's findings as JSON to check it against."""
    model, page = str(EXAMPLES / example), folder / "report.html"
    expected_file = folder / "expected.json"
    extra = tuple(arg.replace("{tmp}", str(folder)) for arg in extra)
    assert _cli(model, "--format", "json", "-o", expected_file, "--fail-on", "never", *_without_verify(extra)) == 0
    assert _cli(model, "--format", "html", "-o", page, "--fail-on", "never", *extra) == 0
    capsys.readouterr()
    return page, json.loads(expected_file.read_text(encoding="utf-8"))


def _not_blank(png: bytes) -> tuple[int, float]:
    from PIL import Image, ImageStat

    image = Image.open(io.BytesIO(png)).convert("RGB")
    colours = image.getcolors(maxcolors=image.width * image.height)
    return len(colours), max(ImageStat.Stat(image).stddev)


@pytest.mark.parametrize(
    "example, extra", CASES, ids=[" ".join((Path(e).stem, *a)).replace(" ", "_") for e, a in CASES]
)
def test_report_renders_offline_in_chromium(browser, example, extra, tmp_path, capsys):
    page_file, expected = _write_page(example, extra, tmp_path, capsys)
    name = "_".join((Path(example).stem, *extra)).replace("-", "").replace("/", "_")
    try:
        SHOTS.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass
    for label, (width, height) in VIEWPORTS.items():
        context = browser.new_context(viewport={"width": width, "height": height}, offline=True)
        page = context.new_page()
        errors, requests, blocked = [], [], []
        # The handlers run while this viewport's page loads, inside this iteration, so late binding is harmless.
        page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)  # noqa: B023
        page.on("pageerror", lambda error: errors.append(str(error)))  # noqa: B023
        page.on("request", lambda request: requests.append(request.url))  # noqa: B023

        def guard(route):
            if route.request.url.startswith(("file:", "data:")):
                route.continue_()
            else:
                blocked.append(route.request.url)  # noqa: B023
                route.abort()

        page.route("**/*", guard)
        page.goto(page_file.as_uri(), wait_until="load")

        assert errors == [], f"console errors at {label}: {errors}"
        assert blocked == [] and all(url.startswith(("file:", "data:")) for url in requests), requests
        body = page.inner_text("body")
        assert expected["verdict"] in body.lower()
        badge = page.inner_text(".summary .badge").strip().lower()
        assert badge == expected["verdict"]
        if expected["critical_layer"] is not None:
            assert expected["critical_layer"] in page.inner_text(".summary .at")
            assert page.locator("svg.graph g.node.critical").count() == 1
            assert page.locator("table.layers tr.critical").count() == 1
        assert page.locator("table.layers tbody tr").count() == len(expected["layers"])
        assert page.evaluate("[...document.images].every(i => i.complete && i.naturalWidth > 0)")
        # What a server could see is drawn at least 128 px wide, pixels as blocks (a 32 px input is unreadable).
        assert page.evaluate(
            "[...document.querySelectorAll('figure.visible-pair img')]"
            ".every(i => i.getBoundingClientRect().width >= 128 && getComputedStyle(i).imageRendering === 'pixelated')"
        )
        if "--verify" in extra:  # originals and reconstructions side by side, embedded in the file
            samples = int(extra[extra.index("--samples") + 1])
            # ... beside the certificate's reference photograph and its top-R_s projection (two more images)
            certificate = page.locator("figure.certificate img").count()
            assert certificate == 2
            assert (
                page.evaluate("[...document.images].filter(i => i.src.startsWith('data:image/png')).length")
                == 2 * samples + certificate
            )
            assert "confirms the static verdict" in body
        # Wide content scrolls inside its own container; the page never scrolls sideways.
        overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
        assert overflow <= 0, f"page is {overflow}px wider than the {label} viewport"

        png = page.screenshot(path=str(tmp_path / f"{name}-{label}.png"))
        try:
            (SHOTS / f"{name}-{width}x{height}.png").write_bytes(png)
            page.screenshot(path=str(SHOTS / f"{name}-{width}x{height}-full.png"), full_page=True)
        except OSError:
            pass
        colours, spread = _not_blank(png)
        assert colours > 20 and spread > 20, f"blank-looking screenshot at {label}: {colours} colours, sd {spread}"
        context.close()


@pytest.mark.slow  # two reports with their verifiers rendered in the browser (24 s)
def test_the_visible_parts_stand_beside_the_verdict(browser):
    """--verify rank on Figure 2(e): the verdict card shows the photograph beside its visible part (method.md: verdicts),
    embedded in the file, loaded, and labelled with the measured share."""
    from conftest import rank_check

    _, payload, page_file = rank_check("fig2_e", "--samples", "1")
    context = browser.new_context(viewport={"width": 1280, "height": 900}, offline=True)
    page = context.new_page()
    errors = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(page_file.as_uri(), wait_until="load")
    assert errors == []
    assert page.inner_text(".summary .badge").strip().lower() == "exposed" == payload["verdict"]
    pictures = page.locator(".summary .visible-parts img")
    assert pictures.count() == 2
    assert [pictures.nth(i).get_attribute("alt") for i in range(2)] == ["input 0", "visible part of input 0"]
    assert page.evaluate(
        "[...document.querySelectorAll('.visible-parts img')]"
        ".every(i => i.src.startsWith('data:image/png') && i.complete && i.naturalWidth === 32"
        " && i.getBoundingClientRect().width >= 128)"
    )
    caption = page.inner_text(".visible-parts .visible-pair figcaption")
    # The share is each sample's detail (its difference from the reference's mean) that the gradient does not see.
    shown = re.search(r"hidden ([0-9.]+) %, ([0-9.]+) dB, SSIM ([0-9.]+)", caption)
    assert shown is not None, caption
    assert float(shown.group(1)) < 5 and float(shown.group(2)) > 20 and float(shown.group(3)) > 0.9
    assert "the gradient shows the image" in page.inner_text(".what-it-shows")
    shot = page.locator(".summary .visible-parts").screenshot()
    colours, spread = _not_blank(shot)
    assert colours > 20 and spread > 10, f"blank-looking visible parts: {colours} colours, sd {spread}"
    try:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "fig2_e_verify_rank-1280x900.png"))
    except OSError:
        pass
    context.close()
