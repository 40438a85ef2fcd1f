"""`vllm serve` with tandem's plugin on another host: the trainer streams its weights there across the network, with
nothing set but the server's URL."""

import json

from tests.hosts.conftest import check, network, recipe, tandem, wait_healthy  # noqa: F401 - network: the fixture
from tests.vllm.conftest import REPO, START_S, TOKEN_GAP, assert_on_policy, require_environment


def test_the_weight_stream_reaches_vllm_on_another_host_on_policy(network, tmp_path):  # noqa: F811 - the fixture
    require_environment()
    trainer, server = network(2)
    command = [str(REPO / "scripts" / "vllm_serve.sh"), "tiny", "--host", server.address, "--port", "8100"]
    server.popen(command, tmp_path / "vllm.log")
    url = f"http://{server.address}:8100"
    wait_healthy(trainer, url, START_S)
    task = recipe(tmp_path / "recipe.yaml", vllm_server_base_url=url, max_steps=6, weight_sync_check_atol=TOKEN_GAP)
    check(trainer.run(tandem("train", task), timeout=600), "training against vllm serve on another host")
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert_on_policy(records, 6)
