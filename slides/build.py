"""Build the instructors' reveal.js decks from the read-along notebooks, for offline use.

    python slides/build.py                      # every notebooks/*.ipynb -> build/slides/
    python slides/build.py notebooks/00_single_device.ipynb
    python slides/build.py --copy-assets        # a self-contained folder (no symlinks)

`make slides` runs `npm ci` in slides/ first, then this script. Each notebook becomes
`<out>/<name>.slides.html`; next to the decks, `<out>/assets/` holds reveal.js, require.js,
jQuery and MathJax 2 from the pinned npm packages in slides/package-lock.json (relative
symlinks into slides/node_modules by default, real copies with --copy-assets). Nothing is
fetched from the network when a deck is opened: the build refuses to write a deck that would
load an external http(s) resource.

What the decks use from a notebook (set in Jupyter: View > Cell Toolbar > Slideshow, or the
property inspector in JupyterLab):
- cell slide types: "slide", "subslide", "fragment", "-" (continue), "skip", "notes"
  (speaker notes: open the speaker view with the S key);
- cell tags: "hide-input"/"remove-input" (show only the output), "hide-output"/
  "remove-output" (show only the code), "remove-cell" (leave the cell out of the slides).
The decks show the outputs stored in the notebook; nothing is executed.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

SLIDES_DIR = Path(__file__).resolve().parent
REPO = SLIDES_DIR.parent
NODE_MODULES = SLIDES_DIR / "node_modules"
NPM_STAMP = NODE_MODULES / ".installed"  # also the Makefile's stamp target
TEMPLATES = SLIDES_DIR / "templates"
DEFAULT_OUT = REPO / "build" / "slides"
NOTEBOOKS = REPO / "notebooks"

ASSETS = "assets"  # folder next to the decks; the decks refer to it by this relative path
# npm package -> the files a deck loads from it (checked after install, relative to the package)
PACKAGES = {
    "reveal.js": ["dist/reveal.js", "dist/reveal.css", "plugin/notes/notes.js"],
    "requirejs": ["require.js"],
    "jquery": ["dist/jquery.min.js"],
    "mathjax": ["MathJax.js", "config/TeX-AMS_CHTML-full.js"],
}
# Parts of the packages a deck never loads; left out by --copy-assets.
COPY_IGNORE = shutil.ignore_patterns("unpacked", "test", "*.map", "node_modules")

# "white" loads its font from reveal.js itself; several other reveal themes (including
# nbconvert's default, "simple") @import Google Fonts.
THEME = "white"
TAG_REMOVE = {
    "remove_input_tags": {"hide-input", "remove-input"},
    "remove_all_outputs_tags": {"hide-output", "remove-output"},
    "remove_cell_tags": {"remove-cell"},
}


class SlidesError(RuntimeError):
    """A deck cannot be built; the message says what to do."""


# --------------------------------------------------------------------------- npm assets


def pinned_versions() -> dict[str, str]:
    """The exact versions slides/package.json pins."""
    deps = json.loads((SLIDES_DIR / "package.json").read_text())["dependencies"]
    missing = set(PACKAGES) - set(deps)
    if missing:
        raise SlidesError(f"slides/package.json does not pin {sorted(missing)}")
    return {name: deps[name] for name in PACKAGES}


def check_node_modules() -> None:
    """Raise SlidesError unless slides/node_modules holds exactly the pinned packages."""
    problems = []
    for name, version in pinned_versions().items():
        meta = NODE_MODULES / name / "package.json"
        if not meta.is_file():
            problems.append(f"{name} is not installed")
            continue
        installed = json.loads(meta.read_text()).get("version")
        if installed != version:
            problems.append(f"{name} is {installed}, package.json pins {version}")
            continue
        problems += [f"{name}/{f} is missing" for f in PACKAGES[name] if not (meta.parent / f).is_file()]
    if problems:
        raise SlidesError(
            "the slide assets in slides/node_modules are missing or stale ("
            + "; ".join(problems)
            + "): run `make slides` (it runs `npm ci` in slides/)"
        )


def npm_ci() -> None:
    """Install the pinned assets exactly as slides/package-lock.json says (`npm ci`)."""
    npm = shutil.which("npm")
    if npm is None:
        raise SlidesError(
            "npm was not found: install Node.js 18 or newer (it brings npm), then run `make slides`"
        )
    proc = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund"], cwd=SLIDES_DIR, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise SlidesError(f"`npm ci` in slides/ failed:\n{proc.stdout}\n{proc.stderr}")
    NPM_STAMP.touch()


def install_assets(out_dir: Path, copy: bool = False) -> Path:
    """Put the pinned packages in `out_dir/assets/`; relative symlinks, or copies if `copy`."""
    check_node_modules()
    assets = out_dir / ASSETS
    assets.mkdir(parents=True, exist_ok=True)
    for name in PACKAGES:
        source, target = NODE_MODULES / name, assets / name
        if copy:
            if target.is_symlink():
                target.unlink()
            if not target.is_dir():
                shutil.copytree(source, target, ignore=COPY_IGNORE)
            continue
        link = Path(os.path.relpath(source, assets))
        if target.is_symlink() and Path(os.readlink(target)) == link:
            continue
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.is_dir():
            shutil.rmtree(target)  # a copy from an earlier --copy-assets build
        target.symlink_to(link, target_is_directory=True)
    return assets


# ------------------------------------------------------------------ offline verification

_URL = re.compile(r"""https?://[^\s"'<>()\\]+""", re.IGNORECASE)
_CSS_FETCH = re.compile(r"""(?:@import\s+(?:url\()?|url\()\s*['"]?(https?://[^'")\s]+)""", re.IGNORECASE)
# XML namespace names look like URLs but are identifiers that no browser fetches.
NAMESPACE_PREFIX = "http://www.w3.org/"
# Attributes whose value a browser may fetch (a[href] is navigation, listed separately).
_FETCH_ATTRS = {"src", "href", "srcset", "data", "poster", "background", "xlink:href", "action", "style"}


class _Scanner(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.fetched: list[str] = []  # "<tag attr>: url" for every external URL a browser could load
        self.links: list[str] = []  # external hyperlinks: only followed when clicked
        self._code: str | None = None

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if not value or name not in _FETCH_ATTRS:
                continue
            if tag == "a" and name == "href":
                self.links += _URL.findall(value)
                continue
            urls = [u for u in _URL.findall(value) if not u.startswith(NAMESPACE_PREFIX)]
            self.fetched += [f"<{tag} {name}>: {u}" for u in urls]
        if tag in ("script", "style"):
            self._code = tag

    def handle_endtag(self, tag):
        if tag == self._code:
            self._code = None

    def handle_data(self, data):
        if self._code:  # inside <script> or <style> every URL counts (require paths, @import...)
            urls = [u for u in _URL.findall(data) if not u.startswith(NAMESPACE_PREFIX)]
            self.fetched += [f"<{self._code}>: {u}" for u in urls]


def scan_html(text: str) -> _Scanner:
    scanner = _Scanner()
    scanner.feed(text)
    scanner.close()
    return scanner


def local_asset_paths(text: str) -> list[str]:
    """Every `assets/...` file a deck refers to (tags, require() paths, MathJax), no query."""
    found = {m.split("?")[0] for m in re.findall(rf"""{ASSETS}/[^\s"'<>)]+""", text)}
    # require() names modules without ".js"; both spellings appear in a deck
    return sorted(p for p in found if not p.endswith("/"))


def offline_problems(deck: Path) -> list[str]:
    """Why `deck` would not work offline: external resources, missing local files, CSS imports."""
    text = deck.read_text(encoding="utf-8")
    problems = [f"external resource {f}" for f in scan_html(text).fetched]
    for rel in local_asset_paths(text):
        path = deck.parent / rel
        if not path.is_file():
            problems.append(f"missing local file {rel}")
        elif path.suffix == ".css":
            problems += [f"{rel} imports {u}" for u in _CSS_FETCH.findall(path.read_text(errors="replace"))]
    return problems


# ---------------------------------------------------------------------------- the build


_STYLE = re.compile(r"(<style[^>]*>)(.*?)(</style>)", re.IGNORECASE | re.DOTALL)
_CSS_COMMENT = re.compile(r"/\*.*?\*/", re.DOTALL)


def strip_css_comments(text: str) -> str:
    """Drop the comments of inline <style> blocks (JupyterLab's CSS credits its sources by URL)."""
    return _STYLE.sub(lambda m: m[1] + _CSS_COMMENT.sub("", m[2]) + m[3], text)


def _exporter():
    from nbconvert import SlidesExporter  # imported here: `--help` and the checks stay fast
    from traitlets.config import Config

    c = Config()
    c.SlidesExporter.extra_template_basedirs = [str(TEMPLATES)]
    c.SlidesExporter.template_name = "offline"
    c.SlidesExporter.reveal_url_prefix = f"{ASSETS}/reveal.js"
    c.SlidesExporter.reveal_theme = THEME
    c.SlidesExporter.reveal_number = "c/t"
    c.SlidesExporter.require_js_url = f"{ASSETS}/requirejs/require.js"
    c.SlidesExporter.jquery_url = f"{ASSETS}/jquery/dist/jquery.min.js"
    c.SlidesExporter.mathjax_url = f"{ASSETS}/mathjax/MathJax.js?config=TeX-AMS_CHTML-full,Safe"
    c.SlidesExporter.exclude_input_prompt = True
    c.SlidesExporter.exclude_output_prompt = True
    c.TagRemovePreprocessor.enabled = True
    for option, tags in TAG_REMOVE.items():
        setattr(c.TagRemovePreprocessor, option, set(tags))
    return SlidesExporter(config=c)


def build_deck(notebook: Path | str, out_dir: Path | str = DEFAULT_OUT, *, copy_assets: bool = False) -> Path:
    """Build one notebook's offline deck; return the path of `<out_dir>/<name>.slides.html`."""
    notebook, out_dir = Path(notebook), Path(out_dir)
    if not notebook.is_file():
        raise SlidesError(f"notebook not found: {notebook}")
    install_assets(out_dir, copy=copy_assets)
    body, _ = _exporter().from_filename(str(notebook))
    deck = out_dir / f"{notebook.stem}.slides.html"
    deck.write_text(strip_css_comments(body), encoding="utf-8")
    problems = offline_problems(deck)
    if problems:
        deck.unlink()
        raise SlidesError(f"{notebook} would not work offline:\n  " + "\n  ".join(problems))
    return deck


def write_index(decks: list[Path], out_dir: Path) -> Path:
    """A plain page linking every deck, so instructors open one file."""
    items = "\n".join(
        f'<li><a href="{html.escape(d.name)}">{html.escape(d.name.removesuffix(".slides.html"))}</a></li>'
        for d in sorted(decks)
    )
    page = out_dir / "index.html"
    page.write_text(
        "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>minimegatron slides</title></head>\n"
        f"<body><h1>minimegatron slides</h1>\n<p>Press S in a deck for the speaker notes.</p>\n"
        f"<ul>\n{items}\n</ul>\n</body></html>\n",
        encoding="utf-8",
    )
    return page


def build_all(notebooks: list[Path] | None = None, out_dir: Path | str = DEFAULT_OUT, *, copy_assets: bool = False) -> list[Path]:
    out_dir = Path(out_dir)
    notebooks = sorted(NOTEBOOKS.glob("*.ipynb")) if notebooks is None else notebooks
    decks = [build_deck(nb, out_dir, copy_assets=copy_assets) for nb in notebooks]
    if decks:
        write_index(list(out_dir.glob("*.slides.html")), out_dir)
    return decks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (default: build/slides)")
    parser.add_argument("--copy-assets", action="store_true", help="copy the assets instead of symlinking them, for a folder you can move")
    args = parser.parse_args(argv)
    try:
        decks = build_all(args.notebooks or None, args.out, copy_assets=args.copy_assets)
    except SlidesError as err:
        print(f"slides: error: {err}", file=sys.stderr)
        return 1
    if not decks:
        print(f"slides: no notebooks in {NOTEBOOKS.relative_to(REPO)}/, nothing to build")
        return 0
    for deck in decks:
        print(f"slides: wrote {_shown(deck)}")
    print(f"slides: open {_shown(Path(args.out) / 'index.html')} in a browser (works offline; S opens the speaker notes)")
    return 0


def _shown(path: Path) -> str:
    """`path` relative to the working directory when it is inside it, else absolute."""
    path = path.resolve()
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.exit(main())
