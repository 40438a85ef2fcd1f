"""Weights streamed into `tandem serve --weight-transfer-config '{"backend":"gloo"}'` without the disk: directly,
through `tandem proxy` to two replicas, and a transfer that fails midway; and the NCCL plane's use of vLLM's helpers,
with gloo stand-ins for them (tests/runtime/vllm_stand_in: vLLM is not installed here and NCCL needs GPUs)."""

import asyncio
import concurrent.futures
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.generation.client import (
    Completion,
    ControlClient,
    EngineDead,
    GenerationClient,
    ServerError,
    ServerProblem,
)
from tandem.generation.launcher import EmbeddedProxy
from tandem.kernels import onednn_linear
from tandem.packing import tree_attention
from tandem.runtime import weight_transfer
from tandem.runtime.weight_sync import nccl_plane
from tandem.runtime.weight_transfer import (
    GlooPlane,
    InThread,
    TransferFailed,
    TransferSync,
    VllmNcclPlane,
    control_call,
    first_failure,
)
from tandem.serve.weight_receiver import Receiver, pack_chunks
from tandem.tasks import TINY_MODEL_PATH
from tests.conftest import ServeProcess, ServerThread, chat_prompt, probe_gap

ATOL = 1e-5
GLOO = '{"backend": "gloo"}'


def trained_model(seed: int) -> torch.nn.Module:
    """The tiny model (fp32, tree attention) after what an optimizer step does to every weight."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    tree_attention.prepare(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def gaps(run, urls: list[str], model, prompt) -> list[float]:
    """The probe's largest served-vs-trainer log-prob gap on each server."""
    result = []
    for url in urls:
        client = GenerationClient(url)
        result.append(probe_gap(run, client, TINY_MODEL_PATH, model, prompt).max_abs)
        run.run(client.close())
    return result


def test_each_transfer_is_served_exactly_and_a_failed_one_leaves_the_previous_weights(tokenizer, monkeypatch):
    server = ServerThread(weight_transfer_config=GLOO, weight_transfer_timeout_s=5)
    prompt = chat_prompt(tokenizer, "What is 12 + 30?")
    with asyncio.Runner() as run:
        control = ControlClient(server.url)
        sync = TransferSync(control, run, TINY_MODEL_PATH, timeout_s=20)
        assert sync.connect() == 1
        pauses = []
        monkeypatch.setattr(control, "pause", lambda *args: pauses.append(args))
        for version in (1, 2):
            model = trained_model(seed=version)
            assert sync.push(model, version)["perf/weight_sync_pause_s"] < 0.01
            assert not pauses, (
                "tandem serve swaps the staged weights between engine steps: it generates during a transfer"
            )
            assert gaps(run, [server.url], model, prompt)[0] <= ATOL, f"version {version} is not what the server serves"
        assert run.run(control.get_json("/weight_info")) == {"weight_version": "2"}

        calls = 0

        def dies_midway(tensor):
            nonlocal calls
            calls += 1
            if calls == 10:
                raise RuntimeError("simulated loss of the trainer's network")
            return tensor

        monkeypatch.setattr(weight_transfer, "full_tensor", dies_midway)
        with pytest.raises(
            TransferFailed, match="version 3 failed: simulated loss.*keeps serving the previous weights"
        ):
            sync.push(trained_model(seed=3), 3)
        assert gaps(run, [server.url], model, prompt)[0] <= ATOL, "a failed transfer must leave version 2 served"
        assert not run.run(control.is_paused()), "generation goes on after a failed transfer"
        run.run(control.close())
    server.close()


def test_a_transfer_reaches_the_weights_fast_decoding_reordered_for_onednn(tokenizer, monkeypatch):
    monkeypatch.setattr(onednn_linear, "MIN_ELEMENTS", 0)  # the tiny model's layers too
    server = ServerThread(weight_transfer_config=GLOO, decode_mode="fast")
    prompt = chat_prompt(tokenizer, "What is 12 + 30?")
    with asyncio.Runner() as run:
        control = ControlClient(server.url)
        sync = TransferSync(control, run, TINY_MODEL_PATH, timeout_s=20)
        assert sync.connect() == 1
        gaps(run, [server.url], trained_model(seed=1), prompt)  # a first forward: the served weights are reordered
        model = trained_model(seed=2)
        sync.push(model, 2)
        gap = gaps(run, [server.url], model, prompt)[0]
        assert gap <= 1e-4, (
            f"fast decoding serves {gap:.2e} away from the weights transferred"
        )  # SDPA, oneDNN: not bitwise
        run.run(control.close())
    server.close()


def test_a_transfer_broken_by_a_dead_engine_is_reported_as_the_engine_dying(monkeypatch):
    class Health:
        def __init__(self, dead: bool):
            self.dead, self.asked = dead, 0

        async def raise_if_engine_dead(self):
            self.asked += 1
            if self.dead:
                raise EngineDead(503, "a call waiting on the engine will not be answered", "http://server/health")

    monkeypatch.setattr(weight_transfer, "ENGINE_WATCH_S", 0.01)
    broken = RuntimeError("Connection closed by peer [127.0.0.1]:6311")  # how gloo sees vLLM's engine process die
    with asyncio.Runner() as run:
        dead, alive = Health(dead=True), Health(dead=False)
        assert isinstance(TransferSync(dead, run, "m")._engine_death(broken), EngineDead), "/health says it died"
        assert TransferSync(alive, run, "m")._engine_death(broken) is broken, "a live engine: the transfer's own error"
        assert alive.asked == weight_transfer.ENGINE_DEATH_CHECKS, "asked again: /health lags the engine's death"


def test_a_server_without_transfer_or_with_a_bad_update_answers_as_vllm(tokenizer):
    plain = ServerThread()
    status, body = plain.post("/init_weight_transfer_engine", {"init_info": {}})
    assert status == 500 and "Weight transfer not configured" in body["error"]["message"]
    plain.close()
    server = ServerThread(weight_transfer_config=GLOO)
    assert server.post("/update_weights", {"update_info": {"names": []}})[0] == 400
    status, body = server.request("POST", "/start_weight_update", raw=b"{not json")
    assert status == 400 and "JSON decode error" in body["error"]["message"], "a bad body is the client's mistake"
    status, body = server.post("/start_weight_update")
    assert status == 400 and "before /init_weight_transfer_engine" in body["error"]["message"]
    status, body = server.post("/init_weight_transfer_engine", {"init_info": {"master_port": 1}})
    assert status == 400 and "master_address" in body["error"]["message"]
    server.close()


def test_a_transfer_through_tandem_proxy_reaches_both_replicas(tokenizer):
    replicas = [ServerThread(weight_transfer_config=GLOO) for _ in range(2)]
    proxy = EmbeddedProxy([r.url for r in replicas])
    prompt = chat_prompt(tokenizer, "What is 7 + 5?")
    try:
        with asyncio.Runner() as run:
            control = ControlClient(proxy.url)
            sync = TransferSync(control, run, TINY_MODEL_PATH, timeout_s=30)
            assert sync.connect() == 2, "one group: the trainer and both replicas"
            for version in (1, 2):
                model = trained_model(seed=10 + version)
                sync.push(model, version)
                served = gaps(run, [r.url for r in replicas], model, prompt)
                assert max(served) <= ATOL, f"version {version}: probe gaps {served}"
            # An update the replicas refuse (a name they lack) is received whole, then served by none.
            run.run(control.start_weight_update())
            call = InThread(control_call(control, 30, lambda c: c.update_weights(["not.a.weight"], ["float32"], [[2]])))
            sync.plane.group.broadcast(torch.zeros(2), 0).wait()
            with pytest.raises(ServerError, match="2/2 servers failed /update_weights.*not a parameter"):
                call.result(30)
            run.run(control.finish_weight_update("bad"))
            assert max(gaps(run, [r.url for r in replicas], model, prompt)) <= ATOL
            run.run(control.close())
    finally:
        proxy.stop()
        for replica in replicas:
            replica.close()


def test_the_nccl_plane_without_vllm_or_a_gpu_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # as when the vllm extra is not installed
    with pytest.raises(ImportError, match=r"pip install 'tandem-rl\[vllm\]'.*or start vllm serve without"):
        VllmNcclPlane(torch.device("cpu"))
    with pytest.raises(ServerProblem, match="over NCCL, which needs the trainer on a GPU; this model is on cpu"):
        nccl_plane(torch.nn.Linear(2, 2))


@pytest.fixture
def vllm_stand_in(monkeypatch):
    """vLLM's trainer-side helpers replaced by tests/runtime/vllm_stand_in (gloo, unpacked), recording their calls."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent / "vllm_stand_in"))
    from vllm.distributed.weight_transfer import packed_tensor

    yield packed_tensor
    for name in [n for n in sys.modules if n == "vllm" or n.startswith("vllm.")]:
        del sys.modules[name]  # later tests see vLLM as not installed again


def test_the_nccl_plane_drives_vllms_rendezvous_and_packed_broadcast(tokenizer, vllm_stand_in):
    server = ServerThread(weight_transfer_config=GLOO, weight_transfer_timeout_s=5)
    prompt = chat_prompt(tokenizer, "What is 12 + 30?")
    with asyncio.Runner() as run:
        control = ControlClient(server.url)
        plane = VllmNcclPlane(torch.device("cpu"))
        sync = TransferSync(control, run, TINY_MODEL_PATH, timeout_s=5, plane=plane)
        sync.connect()
        assert vllm_stand_in.CALLS[0] == ("trainer_init", {"master_address": "127.0.0.1", "world_size": 2})
        model = trained_model(seed=4)
        sync.push(model, 1)
        assert gaps(run, [server.url], model, prompt)[0] <= ATOL, "the weights vLLM's broadcast carried are served"
        producer = vllm_stand_in.CALLS[1][1]
        assert producer["names"] == [name for name, _ in model.named_parameters()], "sent in the announced order"
        assert plane.init_fields == {
            "packed": True,
            "packed_buffer_size_bytes": producer["buffer_size_bytes"],
            "packed_num_buffers": producer["num_buffers"],
        }, "the packing told the server is used"

        vllm_stand_in.HANG.set()  # a peer that never takes part: NCCL would wait forever
        # vLLM loads in place, so a failed transfer may have left part of it loaded: the run stops, it does not sync again
        # Both ends wait 5 s: whichever gives up first is the error (the broadcast, or the server's receive)
        with pytest.raises(
            ServerProblem,
            match="version 2 failed: .*(NCCL broadcast .* did not complete within 5s|Timed "
            "out waiting 5000ms).*restart",
        ):
            sync.push(trained_model(seed=5), 2)
        vllm_stand_in.HANG.clear()
        assert gaps(run, [server.url], model, prompt)[0] <= ATOL, "a failed transfer must leave version 1 served"
        run.run(control.close())
    server.close()


def test_the_first_error_of_two_calls_that_wait_on_each_other_ends_the_wait():
    """vLLM refusing /update_weights at once must not leave the trainer in a broadcast nobody joins (up to 30 min)."""
    never = threading.Event()

    def refuse():
        raise RuntimeError("update_weights answered 500")

    start = time.monotonic()
    with pytest.raises(RuntimeError, match="answered 500"):
        first_failure(InThread(lambda: never.wait(60)), InThread(refuse), timeout_s=60)
    assert time.monotonic() - start < 5


def test_packed_buffers_carry_every_dtype_and_shape_exactly_across_several_buffers(monkeypatch):
    assert pack_chunks([60, 14, 40, 160, 4, 32], buffer_bytes=100) == [range(0, 3), range(3, 4), range(4, 6)], (
        "as vLLM packs: a buffer takes tensors until it exceeds its size, the tensor that crosses it included"
    )
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.bfloat16),
        "c": torch.randn(10),
        "big": torch.randn(40),
        "scalar": torch.tensor(2.5),
        "d": torch.ones(2, 2, dtype=torch.int64),
    }
    port = weight_transfer.free_port("127.0.0.1")
    plane, receiver = GlooPlane(buffer_bytes=100), Receiver(timeout_s=20)
    joining = InThread(
        lambda: receiver.init(
            {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2} | plane.init_fields
        )
    )
    plane.open("127.0.0.1", port, 2, 20)
    joining.result(20)
    buffers = []
    monkeypatch.setattr(
        plane, "_broadcast", lambda tensor, real=plane._broadcast: buffers.append(tensor) or real(tensor)
    )
    receiver.start()
    update = {
        "names": list(tensors),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
    }
    receiving = InThread(lambda: receiver.receive(update, tensors))
    plane.send(iter(tensors.items()), 20)
    receiving.result(20)
    staged = receiver.finish()
    assert len(buffers) == 3, "one broadcast per buffer, not per tensor"
    for name, tensor in tensors.items():
        assert staged[name].dtype == tensor.dtype and torch.equal(staged[name], tensor), f"{name} arrived changed"


def test_vllm_gets_each_weight_under_the_checkpoints_name_and_layout(tmp_path):
    """transformers fuses an MoE's experts into one 3D tensor per layer as it loads; vLLM loads the checkpoint's names,
    one tensor per expert and projection: what the stream sends it is what save_pretrained writes, tensor for tensor."""
    from safetensors.torch import load_file

    from tests.conftest import saved_with_tiny_tokenizer
    from tests.families.catalog import BY_NAME

    folder = saved_with_tiny_tokenizer(BY_NAME["Qwen3-MoE"].build(), tmp_path / "moe")
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert "model.layers.0.mlp.experts.gate_up_proj" in dict(model.named_parameters()), "the model holds fused experts"
    sent = dict(
        pair
        for name, p in model.named_parameters()
        for pair in weight_transfer.checkpoint_tensors(model, name, p.detach())
    )
    saved = load_file(f"{folder}/model.safetensors")
    assert sorted(sent) == sorted(saved), f"names differ: {sorted(set(sent) ^ set(saved))[:4]}"
    assert all(torch.equal(sent[name], saved[name]) for name in saved)


def test_weight_versions_label_each_token_with_the_weights_that_sampled_it(tokenizer):
    """A transfer finished while a sequence decodes starts a new span at the first token the new weights sampled."""
    serve = ServeProcess("--weight-transfer-config", GLOO, "--step-delay-s", "0.05", "--enable-scale-out")
    prompt = chat_prompt(tokenizer, "Count to fifty.")
    sampling = {"max_tokens": 60, "ignore_eos": True, "temperature": 1.0, "seed": 1}
    bodies = {
        "/v1/completions": {"prompt": prompt, "return_weight_versions": True, **sampling},
        "/v1/chat/completions": {
            "messages": [{"role": "user", "content": "Count."}],
            "return_weight_versions": True,
            **sampling,
        },
        "/inference/v1/generate": {"token_ids": prompt, "sampling_params": sampling},
    }

    async def through_the_client() -> list[Completion]:  # as the rollout worker asks, for a group of version 3
        client = GenerationClient(serve.url)
        try:
            return await client.complete(prompt, **sampling, return_weight_versions=True)
        finally:
            await client.close()

    try:
        with asyncio.Runner() as run, concurrent.futures.ThreadPoolExecutor(4) as pool:
            control = ControlClient(serve.url)
            sync = TransferSync(control, run, TINY_MODEL_PATH, timeout_s=20)
            assert sync.connect() == 1
            answers = {path: pool.submit(serve.post, path, body) for path, body in bodies.items()}
            client_answer = pool.submit(asyncio.run, through_the_client())
            time.sleep(0.8)  # about 16 of the 60 steps
            sync.push(trained_model(seed=1), 7)
            for path, answer in answers.items():
                status, body = answer.result()
                assert status == 200, body
                (first, second) = body["choices"][0]["weight_versions"]
                assert first["version"] == "default" and second["version"] == "7", f"{path}: {first}, {second}"
                assert first["start"] == 0 and 0 < first["end"] == second["start"] < second["end"] == 60, f"{path}"
            [completion] = client_answer.result()
            versions = completion.token_versions(default=3)
            swapped = versions.index(7)
            assert 0 < swapped and versions == [3] * swapped + [7] * (60 - swapped), (
                "the server's first weights ('default') count as the group's version, the rest as the pushed one"
            )
            status, body = serve.post("/v1/completions", {"prompt": prompt, **sampling})
            assert body["choices"][0]["weight_versions"] is None, "spans only when asked for"
            run.run(control.close())
    finally:
        serve.close()


@pytest.mark.parametrize("recompute", [True, False], ids=["recomputed cache", "kept cache"])
def test_after_a_mid_generation_update_each_token_is_its_versions_exactly_when_the_cache_is_recomputed(
    tokenizer, recompute
):
    """A 60-token generation with a weight update in its middle. With the cache computed again, every token's served
    log-prob is the trainer's forward under the weights that sampled it (before the update the first weights', after
    it the pushed ones'); kept, the tokens after the update read keys and values the old weights computed, and differ
    from both."""
    flags = ["--recompute-kv-cache-after-weight-updates"] if recompute else []
    serve = ServeProcess("--weight-transfer-config", GLOO, "--step-delay-s", "0.05", *flags)
    prompt = chat_prompt(tokenizer, "Count to fifty.")
    body = {"prompt": prompt, "max_tokens": 60, "ignore_eos": True, "temperature": 1.0, "seed": 1, "logprobs": 0}
    body |= {"return_token_ids": True, "return_weight_versions": True}
    pushed = trained_model(seed=1)
    try:
        with asyncio.Runner() as run, concurrent.futures.ThreadPoolExecutor(1) as pool:
            control = ControlClient(serve.url)
            sync = TransferSync(control, run, TINY_MODEL_PATH, timeout_s=20)
            assert sync.connect() == 1
            answer = pool.submit(serve.post, "/v1/completions", body)
            time.sleep(0.8)  # about 16 of the 60 steps
            sync.push(pushed, 7)
            status, served = answer.result()
            run.run(control.close())
    finally:
        serve.close()
    assert status == 200, served
    choice = served["choices"][0]
    spans = [(span["start"], span["end"]) for span in choice["weight_versions"]]
    after = spans[0][1]
    assert spans == [(0, after), (after, 60)] and 0 < after < 60, spans
    output = choice["token_ids"]

    def forward(model) -> torch.Tensor:
        plain = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
        plain.load_state_dict(model.state_dict())
        with torch.no_grad():
            logits = plain(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].double()
        return logits.log_softmax(-1).gather(1, torch.tensor(output)[:, None])[:, 0]

    first = forward(AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32))
    expected = torch.cat([first[:after], forward(pushed)[after:]])
    gaps = (torch.tensor(choice["logprobs"]["token_logprobs"], dtype=torch.float64) - expected).abs()
    assert gaps[:after].max() < 1e-4, f"a token before the update differs from the first weights': {gaps[:after]}"
    if recompute:
        assert gaps[after:].max() < 1e-4, f"a token after the update differs from the pushed weights': {gaps[after:]}"
    else:
        assert gaps[after:].max() > 1e-3, "the kept cache should leave the tokens after the update between versions"
