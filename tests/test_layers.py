"""The architecture's boundaries, checked on the source: each folder imports only from the folders below it
(docs/architecture.md, "Layers"). A new import across a boundary fails here with the module and the name."""

import ast
from pathlib import Path

import tandem

SOURCE = Path(tandem.__file__).parent

GROUND = ("contract", "kernels", "chat", "model")
"""The ground floor's rooms, which every layer may use: what both processes share (records, channels, the algorithm,
the staleness policy), the CPU kernels, chat rendering and tool calls, the model's folder and sharding."""
NEUTRAL = {
    "tandem.__version__",
    "tandem.DISTRIBUTION",
    "tandem.config",
    "tandem.config_checks",
    "tandem.errors",
    "tandem.dataset_rows",
    "tandem.httpapp",
    "tandem.network",
}
"""Single modules any layer may use: the package itself (its version), plain settings, errors and small helpers."""

ALLOWED = {
    **{room: set() for room in GROUND},
    "losses": set(),
    "metrics": set(),
    "serve": set(),
    "generation": set(),
    "proxy": {"generation.client"},
    "packing": {"metrics.window"},
    "rollout": {"generation.client", "generation.server_facts", "metrics"},
    "runtime": {"generation", "serve.weight_receiver", "packing", "metrics", "rollout"},
    "integrations": {"rollout", "generation.client"},
    "tasks": {"integrations"},
    "trainer": {"packing", "losses", "metrics", "runtime", "integrations", "tasks"},
}
"""What each folder may import from the other folders (its own folder, the ground floor and NEUTRAL always)."""


def tandem_imports(path: Path) -> set[str]:
    """Every `tandem...` module `path` imports, at any depth (imports inside functions count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "tandem":
            found |= {f"{node.module}.{a.name}" if node.module == "tandem" else node.module for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "tandem"}
    return found


def crossing(folder: str, module: str) -> bool:
    """Whether importing `module` from a file of `folder` crosses a boundary the architecture does not allow."""
    if module in NEUTRAL or any(
        module == f"tandem.{home}" or module.startswith(f"tandem.{home}.") for home in (folder, *GROUND)
    ):
        return False
    inner = module.removeprefix("tandem.")
    return not any(inner == allowed or inner.startswith(allowed + ".") for allowed in ALLOWED[folder])


def test_every_folder_imports_only_what_its_layer_allows():
    offences = [
        f"{path.relative_to(SOURCE)} imports {module}"
        for folder in ALLOWED
        for path in sorted((SOURCE / folder).glob("*.py"))
        for module in sorted(tandem_imports(path))
        if crossing(folder, module)
    ]
    assert not offences, "imports across the architecture's layers:\n" + "\n".join(offences)


def test_the_check_sees_a_crossing_import():
    assert crossing("rollout", "tandem.trainer.trainer") and crossing("proxy", "tandem.serve.app")
    assert crossing("trainer", "tandem.rollout.worker") and crossing("runtime", "tandem.trainer.checkpoint")
    assert not crossing("runtime", "tandem.rollout.worker") and not crossing(
        "generation", "tandem.kernels.exact_attention"
    )
