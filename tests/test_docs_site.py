"""The documentation site as a reader sees it: `mkdocs build --strict` (as CI runs it), then the
built pages opened in a real headless browser (Debian's chromium, driven by selenium, as in
tests/test_dashboard_browser.py).

The site is built once for this file. Skipped, with the reason, where mkdocs (the docs extra,
also in the test extra), chromium, its driver or selenium are missing. With
MESHTRAIN_DOCS_SCREENSHOTS=DIR the screenshots are kept there (else in the test's tmp folder).
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import importlib.util
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from browser import headless_chromium

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site, built from this checkout exactly as CI builds it (strict)."""
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, build.stdout + build.stderr
    return out


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The built site over HTTP on loopback, as `mkdocs serve` or a static host would serve it."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base's name
        pass


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from headless_chromium("1400,1100")


def _nav_titles(entries: list[object]) -> list[str]:
    titles: list[str] = []
    for entry in entries:
        assert isinstance(entry, dict)
        for title, target in entry.items():
            titles.append(title)
            if isinstance(target, list):
                titles += _nav_titles(target)
    return titles


#: The page's visible prose (code blocks left out), how many code blocks and images it shows,
#: and the images that did not load.
READ_PAGE = """
const article = document.querySelector('article');
const prose = article.cloneNode(true);
prose.querySelectorAll('pre, code').forEach(e => e.remove());
document.body.appendChild(prose);
const text = prose.innerText;
prose.remove();
const images = Array.from(article.querySelectorAll('img'));
return {
  text: text,
  code_blocks: article.querySelectorAll('pre > code').length,
  highlighted: article.querySelectorAll('div.highlight pre').length,
  images: images.length,
  broken: images.filter(i => !i.complete || i.naturalWidth === 0).map(i => i.getAttribute('src')),
  nav: Array.from(document.querySelectorAll('nav.md-nav--primary .md-nav__link'))
            .map(a => a.textContent.trim()).filter(t => t.length > 0),
};
"""


def _read(driver, url: str, screenshot: Path) -> dict[str, object]:  # noqa: ANN001 - a WebDriver
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url)
    WebDriverWait(driver, 30).until(lambda d: d.execute_script(
        "return document.readyState === 'complete' && document.querySelector('article') !== null"))
    driver.save_screenshot(str(screenshot))
    return driver.execute_script(READ_PAGE)


def _screenshots(tmp_path: Path) -> Path:
    kept = os.environ.get("MESHTRAIN_DOCS_SCREENSHOTS")
    folder = Path(kept) if kept else tmp_path
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.mark.parametrize(("page", "shot"), [("", "home.png"), ("guides/custom-strategy/", "guide.png")])
def test_a_page_renders_its_navigation_code_and_images(page: str, shot: str, served: str, browser,  # noqa: ANN001
                                                       tmp_path: Path) -> None:
    screenshot = _screenshots(tmp_path) / shot
    seen = _read(browser, served + page, screenshot)
    assert screenshot.stat().st_size > 10_000  # a page, not a blank window
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    missing = [t for t in _nav_titles(nav) if t not in seen["nav"]]
    assert not missing, (missing, seen["nav"])
    text = str(seen["text"])
    raw = [mark for mark in ("```", "\n# ", "\n## ", "\n### ", "](", "**", "<br", "&lt;")
           if mark in "\n" + text]
    assert not raw, (raw, text[:2000])
    assert seen["code_blocks"] and seen["code_blocks"] == seen["highlighted"], seen
    assert not seen["broken"], seen["broken"]
    if page == "":
        assert seen["images"] >= 1  # the dashboard's picture


def test_the_generated_reference_names_every_command_option_and_setting(site: Path) -> None:
    """The reference is generated from the code at build time: every command of the app with
    every one of its options, and every field of every settings definition, is on its page."""
    import typer

    from meshtrain.cli.main import app
    from meshtrain.config.launching import LaunchSettings
    from meshtrain.config.spec import RunSpec

    cli = (site / "reference" / "cli" / "index.html").read_text()

    def walk(command, path: list[str]) -> Iterator[tuple[str, list[str]]]:  # noqa: ANN001
        ctx = command.context_class(command, info_name=path[-1])
        options = [o for p in command.get_params(ctx)
                   if p.param_type_name == "option" and not getattr(p, "hidden", False) for o in p.opts]
        yield " ".join(path), options
        if hasattr(command, "list_commands"):
            for name in command.list_commands(ctx):
                yield from walk(command.get_command(ctx, name), [*path, name])

    commands = list(walk(typer.main.get_command(app), ["meshtrain"]))
    assert len(commands) > 15
    for title, options in commands:
        section = cli[cli.index(f"<code>{title}</code>"):]
        assert all(option in section for option in options), (title, options)
    api = (site / "reference" / "python-api" / "index.html").read_text()
    for name in ("Trainer", "Strategy", "CommunicationModule", "Communicator", "ThreadCommunicator",
                 "TorchDistCommunicator", "StackedCommunicator"):
        assert re.search(rf'id="meshtrain\.[\w.]*\.{name}"', api), name  # rendered from its docstring
    assert ":class:" not in api and ":meth:" not in api  # the Sphinx roles shown as what they name
    settings = (site / "reference" / "settings" / "index.html").read_text()
    for cls in (RunSpec, LaunchSettings):
        names = [f.name for f in dataclasses.fields(cls) if "help" in f.metadata]
        assert names and all(f"<code>{name}</code>" in settings for name in names), cls
