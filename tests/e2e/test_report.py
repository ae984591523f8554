"""`scaletrain report`: one self-contained HTML page about real runs, every plot embedded."""

from __future__ import annotations

import base64
import io
import json
import re

import pytest
from PIL import Image

from tests.conftest import built_once, headless_chromium, needs_browser, run_cli, stress_only


def embedded_images(page: str) -> list[Image.Image]:
    """Every <img> on the page, decoded: each must be an embedded PNG that loads."""
    sources = re.findall(r'<img alt="[^"]*" src="([^"]+)"', page)
    assert sources and len(sources) == page.count("<img ")
    images = []
    for src in sources:
        assert src.startswith("data:image/png;base64,"), src[:40]
        image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1])))
        image.load()
        images.append(image)
    return images


def build_report(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    common = ["--dataset", "digits", "--max-steps", "16", "--num-threads", "1"]
    assert run_cli("run", *common, "--nproc-per-node", "1", "--out", str(one)).returncode == 0
    result = run_cli("run", *common, "--nproc-per-node", "2", "--max-restarts", "1",
                     "--checkpoint-every", "4", "--inject", "kill:rank=1:step=10",
                     "--eval-every", "4", "--lr-schedule", "cosine", "--out", str(two))  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = tmp_path / "page" / "report.html"
    result = run_cli("report", str(one), str(two), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    assert str(out) in result.stdout


@pytest.fixture(scope="session")
def report_page(tmp_path_factory):
    """A report of real runs: 1 worker, and 2 workers with rank 1 killed and restarted,
    evaluated every 4 steps under a cosine schedule (built once per session)."""
    return built_once(tmp_path_factory, "report", build_report) / "page" / "report.html"


def test_report_of_two_world_sizes_and_a_failure(report_page):
    page = report_page.read_text()
    for title in ("Loss", "Test accuracy during training", "Learning rate",
                  "Samples per second per rank", "Step time breakdown", "The job&#x27;s time",
                  "Scaling", "Where the time goes, by world size",
                  "Recoveries of two"):  # fmt: skip
        assert f"<h2>{title}</h2>" in page
    assert "Staleness" not in page  # no parameter-server run here
    images = embedded_images(page)
    assert len(images) == 9 and all(i.width > 300 and i.height > 200 for i in images)
    assert "one" in page and "two" in page


@needs_browser
def test_report_in_headless_chromium(report_page, tmp_path):
    """As a person would see it: every image on the page loads, and nothing logs an error."""
    with headless_chromium() as driver:
        driver.set_window_size(1280, 2000)
        driver.get(report_page.as_uri())
        images = driver.execute_script(
            "return Array.from(document.images).map(i => [i.alt, i.complete, i.naturalWidth])"
        )
        assert len(images) == 9
        for alt, complete, width in images:
            assert complete and width > 300, alt
        assert driver.title == "scaletrain report"
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
        driver.save_screenshot(str(tmp_path / "report.png"))


def test_report_refuses_a_directory_without_summary(tmp_path):
    (tmp_path / "half").mkdir()
    result = run_cli("report", str(tmp_path / "half"), timeout=60)
    assert result.returncode == 2
    assert f"{tmp_path / 'half'} has no summary.json" in result.stderr
    assert "Traceback" not in result.stderr


# Every make stress round (make test's budget: two more runs; the report's plots and tables of
# real runs are checked above).
@stress_only
def test_report_shows_balance_shares_and_each_pushs_learning_rate(tmp_path):
    """A balanced ddp run with a slow rank, and an asp run under the staleness rule: the page
    plots each rank's share and the effective lr of every applied push."""
    common = ["--dataset", "digits", "--num-threads", "1", "--batch-size", "16"]
    balanced, ps = tmp_path / "balanced", tmp_path / "ps"
    result = run_cli("run", *common, "--nproc-per-node", "2", "--max-steps", "12",
                     "--inject", "slow:rank=1:factor=3", "--balance", "speed",
                     "--balance-every", "2", "--out", str(balanced))  # fmt: skip
    assert result.returncode == 0, result.stderr
    result = run_cli("run", *common, "--strategy", "ps", "--nproc-per-node", "3",
                     "--num-servers", "1", "--consistency", "asp", "--max-steps", "6",
                     "--out", str(ps))  # fmt: skip
    assert result.returncode == 0, result.stderr
    out = tmp_path / "report.html"
    result = run_cli("report", str(balanced), str(ps), "--out", str(out), timeout=120)
    assert result.returncode == 0, result.stderr
    page = out.read_text()
    assert "<h2>Balance</h2>" in page and "<h2>Staleness</h2>" in page
    assert all(i.width > 300 for i in embedded_images(page))
    records = [json.loads(line) for line in (ps / "metrics.jsonl").read_text().splitlines()]
    applied = [r for r in records if r["committed"]]
    # Each push's lr is --lr (0.05, the default) times its factor: 1 / (1 + staleness).
    assert applied and all(r["lr"] == pytest.approx(0.05 / (1 + r["staleness"])) for r in applied)


def test_a_plot_without_data_says_why_in_one_line(report_page):
    """The 1-worker run alone (no --eval-every, a constant learning rate): no empty axes;
    each missing plot says in one line why it is missing."""
    one = report_page.parent.parent / "one"
    out = report_page.parent / "one.html"
    assert run_cli("report", str(one), "--out", str(out), timeout=120).returncode == 0
    page = out.read_text()
    assert 'alt="Test accuracy during training"' not in page
    assert 'alt="Learning rate"' not in page
    assert "Not scored during training (--eval-every N" in page
    assert "Constant: 0.05 at every step" in page


def test_rolling_mean():
    from scaletrain.analysis.report import rolling_mean

    assert rolling_mean([2.0, 4.0, 6.0, 8.0], 2) == [2.0, 3.0, 5.0, 7.0]
    assert rolling_mean([], 3) == []
