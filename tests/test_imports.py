"""What each entry point loads, checked in fresh interpreters: serve and proxy never pay for the trainer."""

import subprocess
import sys


def run_fresh(code: str) -> tuple[str, set[str]]:
    """What a fresh interpreter prints running `code`, and the modules it holds afterwards."""
    script = f"import sys\n{code}\nprint('\\nmodules:', *sys.modules)"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120).stdout
    printed, modules = out.split("\nmodules:")
    return printed, set(modules.split())


def test_import_tandem_loads_no_torch_until_a_public_name_is_used():
    assert "torch" not in run_fresh("import tandem")[1]
    trainer = run_fresh(
        "from tandem import AsyncGRPOConfig, AsyncGRPOTrainer, AsyncRolloutLoop, Rollout, RolloutGroup, TurnRecord"
    )[1]
    assert "torch" in trainer
    assert "matplotlib" not in trainer, "the report's plotting library loads only when a report is drawn"


def test_the_proxy_app_imports_neither_torch_nor_transformers():
    modules = run_fresh("import tandem.proxy.app")[1]
    assert "tandem.proxy.app" in modules and "torch" not in modules and "transformers" not in modules


def test_tandem_serve_help_does_not_import_the_trainer():
    printed, modules = run_fresh(
        "from tandem.cli import main\ntry:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass"
    )
    assert "usage: tandem serve" in printed
    assert not any(name.startswith("tandem.trainer") for name in modules)


def test_the_public_names_are_listed_and_importable():
    import tandem

    names = {
        "AsyncGRPOConfig",
        "AsyncGRPOTrainer",
        "AsyncRolloutLoop",
        "Rollout",
        "RolloutGroup",
        "TurnRecord",
        "HarnessAsyncGRPOTrainer",
    }
    assert names <= set(tandem.__all__) and names <= set(dir(tandem))
    assert all(getattr(tandem, name).__name__ == name for name in names)


def test_the_trainer_asks_for_passive_openmp_waiting_before_torch_loads():
    printed, _ = run_fresh(
        "import os\nos.environ.pop('OMP_WAIT_POLICY', None)\nimport tandem.trainer\n"
        "print(os.environ['OMP_WAIT_POLICY'], tandem.trainer.OPENMP_POLICY_TOO_LATE)"
    )
    assert printed.split() == ["PASSIVE", "False"]
    printed, _ = run_fresh(
        "import os\nos.environ.pop('OMP_WAIT_POLICY', None)\nimport torch\nimport tandem.trainer\n"
        "print(tandem.trainer.OPENMP_POLICY_TOO_LATE)"
    )
    assert printed.split() == ["True"], "torch loaded first: train() must warn that the policy came too late"
