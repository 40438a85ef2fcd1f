"""Draw the documentation's pictures into docs/images/, from real runs and from the code's own structure:

- demo_reward.png: the demo's reward per step (a 300-step run of `tandem train demo`, or RUN_DIR when given);
- flash_reinforce_reward.png: the same for examples/flash_reinforce/cpu.yaml;
- report.png: the top of that demo run's report.html, as Chromium shows it (needs chromium);
- architecture.png: the processes of a run and what flows between them.

    python scripts/make_doc_images.py [--demo-run RUN_DIR] [--flash-run RUN_DIR]   (about 5 minutes on 2 cores)
"""

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "docs" / "images"


def train(recipe: str, folder: Path, name: str) -> Path:
    """Run `recipe` from `folder` into runs/NAME there (relative, as its report then names it)."""
    folder.mkdir(parents=True, exist_ok=True)
    recipe = recipe if recipe == "demo" else str(ROOT / recipe)
    subprocess.run(
        [sys.executable, "-m", "tandem", "train", recipe, "--output_dir", f"runs/{name}"], cwd=folder, check=True
    )
    return folder / "runs" / name


def rewards(run_dir: Path) -> list[tuple[int, float]]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["reward"]) for r in records if "reward" in r and "step" in r]


def reward_curve(run_dir: Path, title: str, path: Path) -> None:
    """Each step's mean reward and its 20-step running mean."""
    steps, values = zip(*rewards(run_dir))
    window = [sum(values[max(0, i - 19) : i + 1]) / len(values[max(0, i - 19) : i + 1]) for i in range(len(values))]
    fig, ax = plt.subplots(figsize=(7, 3.2), dpi=120)
    ax.plot(steps, values, color="#9ab", linewidth=0.8, label="each step")
    ax.plot(steps, window, color="#136", linewidth=2, label="mean of the last 20 steps")
    ax.set(xlabel="step", ylabel="mean reward", title=title, ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def box(ax, x, y, w, h, title, lines, color):
    ax.add_patch(
        FancyBboxPatch(
            (x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.03", facecolor=color, edgecolor="#234", linewidth=1.2
        )
    )
    ax.text(x + w / 2, y + h - 0.06, title, ha="center", va="top", fontsize=11, weight="bold")
    ax.text(x + w / 2, y + h - 0.2, "\n".join(lines), ha="center", va="top", fontsize=8.5, linespacing=1.4)


def arrow(ax, start, end, label, above=True):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14, linewidth=1.3, color="#234"))
    middle = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + (0.05 if above else -0.05))
    ax.text(*middle, label, ha="center", va="bottom" if above else "top", fontsize=8.5, color="#234")


def architecture(path: Path) -> None:
    """The three kinds of process of a run and what they pass each other."""
    fig, ax = plt.subplots(figsize=(9.5, 3.6), dpi=120)
    ax.set(xlim=(0, 3.6), ylim=(0.2, 1.45))
    ax.axis("off")
    top, height, width = 0.75, 0.62, 0.9
    box(
        ax,
        0.05,
        top,
        width,
        height,
        "trainer",
        ["rank 0, and more under torchrun", "packs samples into rows", "loss, backward, optimizer"],
        "#dfe9f5",
    )
    box(
        ax,
        1.35,
        top,
        width,
        height,
        "rollout worker",
        ["a process of its own", "tools, environments, rewards", "paced by max_staleness"],
        "#e6f2e1",
    )
    box(
        ax,
        2.65,
        top,
        width,
        height,
        "generation servers",
        ["tandem serve or vllm serve", "(tandem proxy in front", "of several replicas)"],
        "#f7ead7",
    )
    arrow(ax, (1.35, 1.06), (0.95, 1.06), "samples")
    arrow(ax, (2.25, 1.18), (2.65, 1.18), "prompts")
    arrow(ax, (2.65, 0.94), (2.25, 0.94), "completions,\nlog-probs", above=False)
    ax.add_patch(
        FancyArrowPatch(
            (0.5, top),
            (3.1, top),
            connectionstyle="arc3,rad=0.25",
            arrowstyle="-|>",
            mutation_scale=14,
            linewidth=1.3,
            color="#a33",
        )
    )
    ax.text(
        1.8,
        0.3,
        "new weights every weight_sync_steps: a gloo or NCCL stream, an adapter, or a folder to reload",
        ha="center",
        va="top",
        fontsize=8.5,
        color="#a33",
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo-run", type=Path, help="a finished run of the demo (default: train one)")
    parser.add_argument("--flash-run", type=Path, help="a finished run of examples/flash_reinforce/cpu.yaml")
    args = parser.parse_args()
    IMAGES.mkdir(exist_ok=True)
    architecture(IMAGES / "architecture.png")
    with tempfile.TemporaryDirectory() as tmp:
        demo = args.demo_run or train("demo", Path(tmp), "demo")
        reward_curve(demo, "tandem train demo: the tiny model learns 2-digit arithmetic", IMAGES / "demo_reward.png")
        flash = args.flash_run or train("examples/flash_reinforce/cpu.yaml", Path(tmp), "flash_reinforce")
        reward_curve(flash, "FlashREINFORCE: examples/flash_reinforce/cpu.yaml", IMAGES / "flash_reinforce_reward.png")
        subprocess.run(
            [
                sys.executable,
                str(ROOT / "scripts" / "check_report_in_chromium.py"),
                str(demo),
                "--screenshot",
                str(IMAGES / "report.png"),
            ],
            check=True,
        )
    print(f"wrote {', '.join(sorted(p.name for p in IMAGES.glob('*.png')))} in {IMAGES}")


if __name__ == "__main__":
    main()
