"""The instructors' slides: offline reveal.js decks built from the notebooks (slides/build.py).

Two decks are built: the chapter-00 notebook's (skipped until the notebook exists) and a small
fixture notebook's (always), each into a temporary folder. The checks: the deck has slides and
speaker notes, the HTML names no external http(s) URL a browser would fetch, every local asset
it names exists, and (when Chromium is installed) a headless browser with the network cut off
renders a slide that is not blank, with reveal.js, its notes plugin and MathJax running.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_build_module():
    spec = importlib.util.spec_from_file_location("minimegatron_slides_build", REPO / "slides" / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


build = _load_build_module()

# Every chapter's notebook gets a deck (chapter 00's must exist), plus the fixture.
NOTEBOOKS = {
    "chapter00": REPO / "notebooks" / "00_single_device.ipynb",
    **{nb.stem: nb for nb in sorted((REPO / "notebooks").glob("*.ipynb")) if nb.stem != "00_single_device"},
    "fixture": REPO / "tests" / "fixtures" / "slides_fixture.ipynb",
}
# nbconvert wraps each slide in two <section>s (the slide and its first subslide) and each
# further subslide in one more, so 10 means at least five slides.
MIN_SECTIONS = {name: 10 for name in NOTEBOOKS} | {"fixture": 7}
MIN_NOTES = {name: 1 for name in NOTEBOOKS} | {"fixture": 2}
URL = re.compile(r"""https?://[^\s"'<>()\\]+""", re.IGNORECASE)


@pytest.fixture(scope="module")
def assets_installed():
    """slides/node_modules as `make slides` leaves it; `npm ci` here if it is missing."""
    try:
        build.check_node_modules()
    except build.SlidesError:
        if shutil.which("npm") is None:
            pytest.skip("npm not found: install Node.js 18+ to build the slides")
        build.npm_ci()
        build.check_node_modules()


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("slides")


@pytest.fixture(scope="module")
def built(assets_installed, out_dir):
    """name -> that notebook's deck, each built once per test run."""
    decks: dict[str, Path] = {}

    def get(name: str) -> Path:
        notebook = NOTEBOOKS[name]
        if not notebook.exists():
            pytest.skip(f"{notebook.relative_to(REPO)}: notebook not written yet")
        if name not in decks:
            decks[name] = build.build_deck(notebook, out_dir)
        return decks[name]

    return get


@pytest.fixture(params=sorted(NOTEBOOKS))
def deck(request, built):
    return request.param, built(request.param)


def test_deck_has_slides_and_speaker_notes(deck):
    name, path = deck
    text = path.read_text(encoding="utf-8")
    sections = len(re.findall(r"<section[\s>]", text))
    notes = len(re.findall(r"""<aside class="notes">""", text))
    assert sections >= MIN_SECTIONS[name], (
        f"{path.name}: {sections} <section> elements, expected at least {MIN_SECTIONS[name]}: "
        "give cells the slide type 'slide' or 'subslide' (cell metadata slideshow.slide_type)"
    )
    assert notes >= MIN_NOTES[name], (
        f"{path.name}: {notes} speaker notes, expected at least {MIN_NOTES[name]}: "
        "give markdown cells the slide type 'notes'"
    )


def test_deck_names_no_external_url(deck):
    name, path = deck
    text = path.read_text(encoding="utf-8")
    scan = build.scan_html(text)
    assert scan.fetched == [], f"{path.name} would load from the network: {scan.fetched}"
    # Beyond what a browser fetches: no http(s) URL at all, not even a hyperlink (the book
    # cites Megatron-LM by repository path), except XML namespace names (identifiers that
    # are never fetched).
    stray = sorted({u for u in URL.findall(text) if not u.startswith(build.NAMESPACE_PREFIX)})
    assert stray == [], f"{path.name} holds external URLs: {stray}"
    if name == "fixture":  # the fixture has no SVG either: its HTML holds no URL at all
        assert URL.findall(text) == []


def test_deck_assets_are_local_and_exist(deck):
    _, path = deck
    text = path.read_text(encoding="utf-8")
    referenced = build.local_asset_paths(text)
    for needed in (
        "assets/reveal.js/dist/reveal.js",
        "assets/reveal.js/dist/reveal.css",
        "assets/reveal.js/plugin/notes/notes.js",  # the speaker view (S key), offline
        "assets/requirejs/require.js",
        "assets/jquery/dist/jquery.min.js",
        "assets/mathjax/MathJax.js",
    ):
        assert needed in referenced, f"{path.name} does not load {needed}"
    missing = [p for p in referenced if not (path.parent / p).is_file()]
    assert missing == [], f"{path.name} refers to missing files: {missing}"
    assert build.offline_problems(path) == []


def test_fixture_cell_metadata_and_tags(built):
    text = built("fixture").read_text(encoding="utf-8")
    assert 'class="fragment"' in text
    assert "M_{\\text{train}}" in text  # the formula is left to MathJax
    assert "data:image/png;base64," in text  # the matplotlib figure...
    assert "plt.subplots" not in text  # ...without its code (tag hide-input)
    assert "SKIPPED-CELL" not in text  # slide type skip
    assert "REMOVED-CELL" not in text  # tag remove-cell
    assert not re.search(r'class="jp-(Input|Output)Prompt', text)  # no In [1]: / Out[1]: prompts


def test_offline_check_catches_cdn_resources(tmp_path):
    page = tmp_path / "bad.slides.html"
    page.write_text(
        '<html><head><script src="https://cdn.example/reveal.js"></script>'
        '<link rel="stylesheet" href="http://cdn.example/theme.css">'
        "<style>@import url(https://fonts.example/css);</style>"
        '<script type="module">import m from "https://cdn.example/mermaid.mjs";</script>'
        '<script src="assets/nowhere.js"></script></head>'
        '<body><a href="https://github.com/NVIDIA/Megatron-LM">Megatron-LM</a>'
        '<svg xmlns="http://www.w3.org/2000/svg"></svg><img src="https://cdn.example/x.png"></body></html>'
    )
    problems = build.offline_problems(page)
    assert len(problems) == 6, problems  # 5 external resources + 1 missing local file
    assert not any("github.com" in p or "w3.org" in p for p in problems)
    assert build.scan_html(page.read_text()).links == ["https://github.com/NVIDIA/Megatron-LM"]


def test_missing_assets_say_run_make_slides(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "NODE_MODULES", tmp_path / "node_modules")
    with pytest.raises(build.SlidesError, match=r"run `make slides`"):
        build.check_node_modules()


def test_nbconvert_template_is_found():
    # the offline template extends nbconvert's reveal template; a renamed base would break it
    assert (build.TEMPLATES / "offline" / "index.html.j2").is_file()
    text = (build.TEMPLATES / "offline" / "index.html.j2").read_text()
    assert "html_head_js_mermaidjs" in text and "plugin/notes/notes.js" in text


# ------------------------------------------------------------------ headless Chromium


def _chromium() -> str | None:
    for name in (os.environ.get("CHROMIUM", ""), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _run_chromium(url: str, profile: Path, *extra: str) -> subprocess.CompletedProcess:
    args = [
        _chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
        # no network at all: every host name fails to resolve and any proxy use fails
        "--host-resolver-rules=MAP * ~NOTFOUND", "--proxy-server=127.0.0.1:9",
        "--window-size=1280,720", "--virtual-time-budget=10000", *extra, url,
    ]  # fmt: skip
    return subprocess.run(args, capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(_chromium() is None, reason="Chromium not installed (apt-get install chromium): render test skipped")
def test_chromium_renders_a_slide_offline(deck, tmp_path):
    from PIL import Image

    name, path = deck
    url = path.resolve().as_uri()
    # the DOM after the scripts ran: reveal.js started with the notes plugin, MathJax typeset
    dom = _run_chromium(url, tmp_path / "profile-dom", "--dump-dom").stdout
    assert re.search(r'<div class="reveal [^"]*\bready\b', dom), f"reveal.js did not start in {path.name}"
    assert re.search(r'data-reveal-plugins="[^"]*\bnotes\b', dom), f"the notes plugin did not load in {path.name}"
    if name == "fixture":
        assert "mjx-chtml" in dom, "MathJax did not typeset the fixture's formula offline"

    # a screenshot of the first slide: not blank, with dark (text) pixels on the white theme
    shot = tmp_path / f"{name}.png"
    proc = _run_chromium(url, tmp_path / "profile-shot", f"--screenshot={shot}")
    assert shot.is_file(), f"no screenshot from Chromium:\n{proc.stderr[-2000:]}"
    with Image.open(shot) as image:
        gray = image.convert("L")
        histogram = gray.histogram()
    pixels = sum(histogram)
    background = max(histogram)
    dark = sum(histogram[:100])
    assert background < pixels, f"{shot} is a single colour: the slide did not render"
    assert dark > 0.001 * pixels, f"{shot} has almost no dark pixels: no text rendered"
