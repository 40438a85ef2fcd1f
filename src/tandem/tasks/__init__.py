"""Built-in tasks and the project's tiny model, used by the demo and the tests."""

from pathlib import Path

TINY_MODEL_PATH = str(Path(__file__).parent / "tiny_model")
"""The shipped tiny Qwen2-architecture model (built by scripts/build_tiny_model.py)."""
