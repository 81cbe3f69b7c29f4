"""The live dashboard in a real headless browser (Debian's chromium, driven by selenium)
while `meshtrain launch --dashboard` trains two ranks over the loopback sshd: the page
lists both hosts and their loss curves grow; a wrong token is refused; Ctrl-C ends the launch
and the page with it.

Skipped, with the reason, where chromium, its driver, selenium or sshd are missing
(CI installs them: .ci/run). With MESHTRAIN_DASHBOARD_SCREENSHOT=PATH the test also
saves the page, mid-run, as a PNG there (how docs/dashboard.png was made).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from browser import headless_chromium
from ssh_fixtures import SshWorld, loopback_world, read_until, start_meshtrain

pytestmark = pytest.mark.slow
HOSTS = ["alpha", "beta"]
SCREENSHOT = os.environ.get("MESHTRAIN_DASHBOARD_SCREENSHOT")
# DiLoCo on digits, for longer than the checks take on any machine (~2 s per 1,200 steps on an
# idle one, where the ranks send 2 statuses a second): once the page has shown what it must,
# the test stops the launch with Ctrl-C rather than wait for the last step.
TRAINING = ["--task", "digits", "--strategy", "diloco", "--steps", "40000",
            "--set", "H=20", "--batch-size", "16", "--threads", "1", "--no-progress"]


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    yield from headless_chromium("1400,1250")


@contextlib.contextmanager
def dashboard_command(runs: Path, banner: str) -> Iterator[str]:
    """`meshtrain dashboard RUNS` running until the block ends: the page's URL, read from the
    line that starts with ``banner``."""
    proc = subprocess.Popen([sys.executable, "-m", "meshtrain", "dashboard", str(runs)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        shown = read_until(proc, [banner], timeout=60)
        yield re.search(r"(http://127\.0\.0\.1:\d+/\?token=[\w-]+)", shown).group(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def loopback_ssh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshWorld]:
    yield from loopback_world(tmp_path_factory)


def _points(driver, chart: str, series: str) -> int:  # noqa: ANN001 - a selenium WebDriver
    """How many points the curve ``series`` of ``chart`` has on the page now (0: none)."""
    return int(driver.execute_script(
        "const p = [...document.querySelectorAll(`#${arguments[0]} path.line`)]"
        ".find(e => e.dataset.series === arguments[1]); return p ? Number(p.dataset.n) : 0;", chart, series))


def _hosts(driver) -> list[str]:  # noqa: ANN001
    return driver.execute_script(
        "return [...document.querySelectorAll('#nodes tbody tr')].map(r => r.dataset.host)")


def test_the_page_shows_every_host_and_growing_curves_while_a_launch_trains(
        browser, loopback_ssh: SshWorld, tmp_path: Path) -> None:  # noqa: ANN001
    from selenium.webdriver.support.ui import WebDriverWait

    port = loopback_ssh.servers[0].port
    inv = loopback_ssh.inventory(tmp_path / "inv.yaml", [{"name": n, "host": "127.0.0.1", "port": port}
                                                        for n in HOSTS], workdir=str(tmp_path / "remote"))
    proc = start_meshtrain(loopback_ssh, "launch", str(inv), "--dashboard", "--out", str(tmp_path / "runs"),
                           "--run-id", "watched", *TRAINING, cwd=tmp_path)
    try:
        shown = read_until(proc, ["dashboard: http://127.0.0.1:"], timeout=60)
        url = re.search(r"dashboard: (http://127\.0\.0\.1:\d+/\?token=[\w-]+)", shown).group(1)
        base, token = url.split("?token=")

        # A wrong or missing token is refused, to a program and in the browser.
        for wrong in (base, f"{base}?token={token[:-2]}", f"{base}api/state?token=x{token}"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(wrong, timeout=10)
            assert refused.value.code == 403
        browser.get(f"{base}?token={token[::-1]}")
        assert "403" in browser.find_element("tag name", "body").text
        assert not browser.find_elements("id", "nodes")

        browser.get(url)
        wait = WebDriverWait(browser, 90, poll_frequency=0.2)
        wait.until(lambda d: _hosts(d) == HOSTS)
        # Each host's loss curve appears, then grows while the ranks train.
        wait.until(lambda d: all(_points(d, "chart-step", h) >= 2 for h in HOSTS))
        before = {h: _points(browser, "chart-step", h) for h in HOSTS}
        wait.until(lambda d: all(_points(d, "chart-step", h) > before[h] + 2 for h in HOSTS))
        for chart in ("chart-bytes", "chart-time"):
            assert all(_points(browser, chart, h) > 0 for h in HOSTS), chart
        states = browser.execute_script(
            "return [...document.querySelectorAll('#nodes tbody tr')].map(r => r.dataset.state)")
        assert set(states) <= {"training", "finishing", "done"}, states
        if SCREENSHOT:
            wait.until(lambda d: all(_points(d, "chart-step", h) > 40 for h in HOSTS))
            time.sleep(1.2)  # one more poll, so the heard column is fresh in the picture
            browser.save_screenshot(SCREENSHOT)
        assert proc.poll() is None, "the launch ended before the page was checked: give it more steps"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 128 + signal.SIGINT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read() if proc.stdout else ""
    assert "SIGINT received; stopping every rank" in shown + out
    with pytest.raises(urllib.error.URLError):  # the dashboard closed with the launch (not a terminal)
        urllib.request.urlopen(url, timeout=5)


def test_a_finished_run_opens_in_the_dashboard_command(browser, tmp_path: Path) -> None:  # noqa: ANN001
    from helpers import MLP, regression_data
    from selenium.webdriver.support.ui import WebDriverWait

    from meshtrain import Trainer

    for seed, name in enumerate(("first", "second")):
        Trainer(MLP(seed), regression_data()).fit(nodes=2, max_steps=40, batch_size=8, seed=seed,
                                                  cluster="gbe", out_dir=str(tmp_path / "runs"), run_id=name,
                                                  progress=False)
    with dashboard_command(tmp_path / "runs", "dashboard of 2 runs: http://127.0.0.1:") as url:
        browser.get(url)
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda d: _points(d, "chart-step", "mean of nodes") == 40)
        assert _points(browser, "chart-projected", "projected on gbe") == 40
        # Tick the second run: both runs' curves are drawn, one each.
        browser.execute_script("document.querySelector('#runs li[data-run=\"second\"] input').click()")
        wait.until(lambda d: [_points(d, "chart-step", run) for run in ("first", "second")] == [40, 40])


def test_a_damaged_run_is_listed_with_its_reason_and_the_others_drawn(browser, tmp_path: Path) -> None:  # noqa: ANN001
    """One run directory that cannot be read made `meshtrain dashboard runs/` exit 2 before any
    page existed: it is listed as damaged, its reason among its events, the others drawn."""
    import json

    from selenium.webdriver.support.ui import WebDriverWait

    for name in ("good", "bad"):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        (folder / "summary.json").write_text(json.dumps({"run_id": name, "nodes": 2, "steps": 3}))
        (folder / "metrics.csv").write_text("step,train_loss,seconds\n1,0.5,0.1\n2,0.4,0.2\n3,0.3,0.3\n")
    (tmp_path / "runs" / "bad" / "summary.json").write_text("{not json")
    with dashboard_command(tmp_path / "runs", "dashboard of 2 runs, 1 damaged: http://127.0.0.1:") as url:
        browser.get(url)
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        state = "return document.querySelector(`#runs li[data-run=\"${arguments[0]}\"] .state`)?.textContent"
        wait.until(lambda d: d.execute_script(state, "bad") == "damaged")
        browser.execute_script("document.querySelector('#runs li[data-run=\"good\"]').click()")
        wait.until(lambda d: _points(d, "chart-step", "mean of nodes") == 3)
        browser.execute_script("document.querySelector('#runs li[data-run=\"bad\"]').click()")
        wait.until(lambda d: "summary.json: unreadable" in d.find_element("id", "events").text)
        assert "damaged" in browser.find_element("id", "run-info").text
