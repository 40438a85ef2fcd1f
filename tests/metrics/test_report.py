"""`tandem report`: report.html holds the doctor's findings, the recipe and one decodable plot per logged panel."""

import base64
import io
import json
import subprocess
import sys
from html.parser import HTMLParser

import pytest
from PIL import Image

from tandem.cli import main
from tandem.metrics import report


class Images(HTMLParser):
    """The data URIs of a page's <img> tags, and its text."""

    def __init__(self):
        super().__init__()
        self.sources, self.text = [], []

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.sources.append(dict(attrs)["src"])

    def handle_data(self, data):
        self.text.append(data)


def read_page(path) -> Images:
    page = Images()
    page.feed(path.read_text())
    return page


def decoded(source: str) -> Image.Image:
    prefix = "data:image/png;base64,"
    assert source.startswith(prefix), f"not an embedded PNG: {source[:40]}"
    image = Image.open(io.BytesIO(base64.b64decode(source[len(prefix) :])))
    image.load()  # decodes every pixel: a truncated or corrupt PNG raises here
    return image


@pytest.mark.slow
@pytest.mark.long  # covered in parts by faster tests; python -m pytest -q -m long runs it
def test_the_demo_writes_a_report_whose_every_embedded_image_decodes(tmp_path):
    run = tmp_path / "demo"
    done = subprocess.run(
        [sys.executable, "-m", "tandem", "train", "examples/demo.yaml", "--max_steps", "4", "--output_dir", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"report: {run / 'report.html'}" in done.stderr
    page = read_page(run / "report.html")
    images = [decoded(source) for source in page.sources]
    pngs = sorted((run / "report").glob("*.png"))
    assert len(images) == len(pngs) >= 8, [p.name for p in pngs]  # reward, ratio, step time, queue, waits, ...
    assert all(image.format == "PNG" and image.width > 300 and image.height > 150 for image in images)
    text = " ".join(page.text)
    assert "bottleneck:" in text and "learning:" in text, "the doctor's findings are at the top"
    assert '"max_staleness": 2' in text, "the recipe is in the page"


def test_a_report_draws_the_panels_logged_and_names_the_others(tmp_path):
    rows = [
        {
            "step": step,
            "reward": step / 10,
            "frac_reward_zero_std": 0.1,
            "perf/step_s": 1.0,
            "perf/fwd_s": 0.2,
            "perf/fwd_bwd_s": 0.6,
            "perf/rollout_wait_s": 0.1,
            "tools/call_frequency": 0.5,
            "tools/calculator/latency_s": 0.01,
            "sampling/importance_sampling_ratio/mean": 9.0,
        }
        for step in range(1, 11)
    ]
    resumed = [{**row, "reward": 0.0} for row in rows[-2:]]  # a run resumed from step 8 logs steps 9 and 10 again
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows + resumed))
    path = report.write(tmp_path)
    assert "10 logged windows, step 10" in path.read_text(), "a step logged again after a resume is drawn once"
    assert sorted(p.stem for p in (tmp_path / "report").glob("*.png")) == [
        "backpressure",
        "importance_ratio",
        "reward",
        "step_time",
        "tools",
    ]
    page = path.read_text()
    assert "Not logged in this run: " in page and "KV-cache usage" in page
    assert "<li class=critical>CRITICAL sync: importance ratio out of bounds" in page
    assert "no run_config.json" in page


def test_tandem_report_on_a_folder_without_metrics_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["report", str(tmp_path)])
    assert stop.value.code == 2 and capsys.readouterr().err.startswith(
        f"tandem report: {tmp_path} has no metrics.jsonl"
    )
