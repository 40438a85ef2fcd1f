"""Weight sync to a running `tandem serve`: adapter-only versions, the merged-weight fallback, and the check that
the server samples from the trainer's weights after each sync."""

import asyncio
import shutil
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from tandem.generation.client import ControlClient, GenerationClient
from tandem.generation.server_facts import facts_of
from tandem.packing import tree_attention
from tandem.runtime import sync_check
from tandem.runtime.weight_sync import LoraSync, ReloadSync, adapter_sync_obstacle, merged_state_dict
from tandem.tasks import TINY_MODEL_PATH
from tests.conftest import chat_prompt, probe_gap

ATOL = 1e-5


def lora_model(seed: int, **config) -> torch.nn.Module:
    """The tiny model (fp32, tree attention) with a random rank-4 adapter, as the trainer would hold it."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    tree_attention.prepare(base)
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "up_proj"],
        lora_dropout=0.0,
        **{"init_lora_weights": False, **config},
    )
    return get_peft_model(base, lora)


def perturb(model: torch.nn.Module, seed: int) -> None:
    """What an optimizer step does to the adapter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.05 * torch.randn_like(p))


def test_after_each_adapter_sync_the_server_matches_the_trainer_and_stale_or_base_adapters_fail(
    server, tokenizer, tmp_path
):
    prompt = chat_prompt(tokenizer, "What is 12 + 30?")
    model = lora_model(seed=1)
    with asyncio.Runner() as run:
        control, client = ControlClient(server.url), GenerationClient(server.url)
        sync = LoraSync(control, tmp_path, run, keep=1)
        gaps = []
        for version in (1, 2, 3):  # each sync loads a new name; the gap to the trainer is rounding only
            perturb(model, seed=version)
            sync.push(model, version)
            gaps.append(probe_gap(run, client, sync.name_for(version), model, prompt))
            if version == 2:
                shutil.copytree(tmp_path / ".vllm_lora" / sync.name_for(2), tmp_path / "stale")
        # A stale adapter (version 2's weights) answering to the new name...
        run.run(control.load_lora("tandem-policy-v4", str(tmp_path / "stale")))
        stale = probe_gap(run, client, "tandem-policy-v4", model, prompt)
        # ...and the base model: a fresh adapter (B = 0) computes exactly the base weights.
        lora_model(seed=5, init_lora_weights=True).save_pretrained(tmp_path / "zero")
        run.run(control.load_lora("tandem-policy-v5", str(tmp_path / "zero")))
        base = probe_gap(run, client, "tandem-policy-v5", model, prompt)
        for name in ("tandem-policy-v3", "tandem-policy-v4", "tandem-policy-v5"):
            run.run(control.unload_lora(name))
        run.run(control.close())
        run.run(client.close())

    for gap in gaps:
        assert gap.tokens == sync_check.PROBE_TOKENS and gap.max_abs <= ATOL, gap
        sync_check.check(gap, ATOL)
    for gap in (stale, base):
        assert gap.max_abs > 1000 * ATOL, gap
        with pytest.raises(sync_check.SyncMismatch, match=gap.served_name):
            sync_check.check(gap, ATOL)


def test_merged_weights_are_the_base_model_plus_the_adapter_under_the_base_names():
    model = lora_model(seed=2)
    merged = merged_state_dict(model)
    plain = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    assert sorted(merged) == sorted(plain.state_dict()), "the files must load into the base architecture"
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 17, 42, 99, 7, 3, 250, 11]])
    with torch.no_grad():
        model.eval()
        expected = model(ids).logits
        got = plain.eval()(ids).logits
    # W + BA merged rounds apart from W x + B(A x): fp32 rounding relative to the logits' scale (up to ~13 here),
    # while the adapter itself moves them by several units (the base model's logits are far off).
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, atol=1e-5 * scale, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (base(ids).logits - expected).abs().max() > 0.1 * scale, "the adapter changes the logits"
    untouched = model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight
    assert not torch.equal(untouched, merged["model.layers.0.self_attn.q_proj.weight"]), "the adapter was added"


@pytest.mark.parametrize(
    "config, lora, parallel, expected",
    [
        ({}, None, {}, "started without LoRA support. Restart it with --enable-lora"),
        ({}, {"max_loras": 4}, {"data_parallel_size": 2}, "data_parallel_size=2"),
        ({"use_dora": True}, {"max_loras": 4}, {}, "DoRA"),
        ({"modules_to_save": ["embed_tokens"]}, {"max_loras": 4}, {}, "modules_to_save"),
        ({"bias": "lora_only"}, {"max_loras": 4}, {}, "bias='lora_only'"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, {"max_loras": 4}, {}, "embed_tokens"),
        ({}, {"max_loras": 4}, {"data_parallel_size": 1}, None),
    ],
)
def test_adapters_the_server_cannot_serve_fall_back_to_merged_sync_with_the_reason(config, lora, parallel, expected):
    peft_config = {"default": LoraConfig(r=4, **{"target_modules": ["q_proj"], **config})}
    facts = facts_of(
        {"version": "0.32.0"},
        {"vllm_config": {"lora_config": lora, "parallel_config": parallel}},
        [{"id": "tiny", "max_model_len": 64}],
    )
    why = adapter_sync_obstacle(peft_config, facts, flags="--enable-lora --max-loras 3")
    assert why == expected if expected is None else expected in why


def probe(atol=None, url=None, dtype="float32") -> sync_check.SyncProbe:
    return sync_check.SyncProbe(
        [1, 2, 3], dtype, SimpleNamespace(weight_sync_check_atol=atol, vllm_server_base_url=url)
    )


def test_the_sync_probe_checks_what_the_settings_and_the_server_call_for():
    assert not any(probe().due(push) for push in (1, 2, 3)), "tandem's own server is checked only on request"
    assert probe(atol=1e-5).due(99)

    external = probe(url="http://gpu-box:8000")
    assert [external.due(push) for push in (1, sync_check.FORCED_PROBES, sync_check.FORCED_PROBES + 1)] == [
        True,
        True,
        False,
    ], "an external server's syncs are probed until one is judged, FORCED_PROBES at most"
    external.settled = True
    assert not external.due(2), "a sync seen to move the server ends the forced probes"
    external.restart()
    assert external.due(1), "a server reached anew is probed as a new one"

    external.fit(max_model_len=10)
    assert external.tokens == 6, "the probe and the one token its scoring asks for fit the server's context"


def test_the_probe_tells_a_missed_sync_from_a_bf16_servers_rounding():
    """Numbers shaped like a bf16 server's against an fp32 trainer on the tiny model (rounding 0.06 RMS, 0.3 at a
    token); an optimizer step that moves the probe's log-probs by 0.5 RMS."""
    torch.manual_seed(0)
    connect = -torch.rand(16, dtype=torch.float64) * 3  # the trainer's log-probs at the first probe
    rounding = 0.06 * torch.randn(16, dtype=torch.float64)
    trained = connect + 0.5 * torch.randn(16, dtype=torch.float64)

    def first_probe(served_dtype):
        p = probe(url="http://gpu-box:8000")
        p.note_server_dtype(served_dtype)
        return p

    def external():
        p = first_probe("bfloat16")
        p.judge("policy", (connect + rounding).tolist(), connect)  # the first probe: the reference
        return p

    healthy = external()
    healthy.judge("policy", (trained + rounding).tolist(), trained)
    assert healthy.settled, "a server that moved with the weights ends the forced probes"

    with pytest.raises(sync_check.SyncMismatch, match="did not reach the server"):
        external().judge("policy", (connect + rounding).tolist(), trained)

    barely = connect + 0.01 * torch.randn(16, dtype=torch.float64)  # a step smaller than the server's rounding
    undecided = external()
    undecided.judge("policy", (connect + rounding).tolist(), barely)
    assert not undecided.settled and undecided.due(2), "too close to tell: the next sync is probed again"

    with pytest.raises(sync_check.SyncMismatch, match="bfloat16 rounding stays under 0.25"):
        first_probe("bfloat16").judge("policy", (trained + rounding).tolist(), connect)  # another checkpoint
    with pytest.raises(sync_check.SyncMismatch, match="float32 rounding stays under 0.001"):
        first_probe("float32").judge("policy", (connect + rounding).tolist(), connect)
    with pytest.raises(sync_check.SyncMismatch, match="weight_sync_check_atol"):
        probe(atol=1e-3, url="http://gpu-box:8000").judge("policy", (connect + rounding).tolist(), connect)
    with pytest.raises(sync_check.SyncMismatch, match="differ from the trainer's by .* on average"):
        external().judge("policy", (trained + 1.0).tolist(), trained)  # neither version: a reload that garbled them

    loose = probe(atol=5.0, url="http://gpu-box:8000")
    loose.note_server_dtype("bfloat16")
    loose.judge("policy", (connect + rounding).tolist(), connect)
    with pytest.raises(sync_check.SyncMismatch, match="did not reach the server"):
        loose.judge("policy", (connect + rounding).tolist(), trained)  # no setting loosens the external checks


def test_against_a_vllm_with_lora_enabled_the_probes_sample_afresh_and_end_after_the_first_trained_sync():
    """vLLM's CPU build started with --enable-lora dies scoring a prompt, so each probe samples its own completion;
    without a shared completion only the mean-gap bound judges, over the connect push and the first trained weights."""
    adapters = probe(url="http://gpu-box:8000")
    adapters.rescored, adapters.completion = False, [7, 8]
    adapters.pushes = 1
    adapters.judge("policy-v0", [-1.0, -2.0], torch.tensor([-1.0, -2.0], dtype=torch.float64))
    adapters.pushes = 2
    adapters.judge("policy-v1", [-3.0, -4.0], torch.tensor([-3.0, -4.0], dtype=torch.float64))  # a new completion
    assert adapters.settled and not adapters.due(3) and not adapters.gave_up()


def test_moved_is_exact_where_the_server_is():
    reference, new = torch.zeros(4, dtype=torch.float64), torch.full((4,), 1e-6, dtype=torch.float64)
    assert sync_check.moved(new, new, reference) is True, "an exact server: any step that moved is seen"
    assert sync_check.moved(reference, new, reference) is False
    assert sync_check.moved(reference, reference, reference) is None, "a step that moved nothing cannot be judged"


def test_a_reload_announces_the_new_version_before_generation_resumes(tmp_path):
    """The rollouts label a streamed token by the version marked when it arrived: were the mark written after the resume,
    a short request finishing in between would have its new tokens labelled with the old version."""
    calls: list[str] = []

    class Control:
        async def pause(self, mode):
            calls.append(f"pause {mode}")

        async def reload_weights(self, path):
            calls.append("reload")

        async def reset_prefix_cache(self):
            calls.append("reset")

        async def resume(self):
            calls.append("resume")

    class Now:
        def run(self, coroutine):
            return asyncio.run(coroutine)

    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH, dtype=torch.float32)
    sync = ReloadSync(Control(), tmp_path, Now(), "tiny")
    sync.push(model, 3, announce=lambda version, since: calls.append(f"announce {version}"))
    assert calls == ["pause keep", "reload", "reset", "announce 3", "resume"]
