"""The model-family matrix: every family in catalog.py packs, serves and trains as the tiny Qwen2 does. Its own CI step
(`python -m pytest -q -m families`), left out of the default run for time (about 20 s a family)."""

import random

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tandem import AsyncGRPOConfig, AsyncGRPOTrainer
from tandem.packing import PADDED, TREE, pack
from tandem.packing.log_probs import row_log_probs
from tandem.serve.engine import Engine
from tandem.serve.requests import EngineRequest
from tandem.serve.sampling import SamplingParams
from tandem.trainer.model import load_model
from tests.conftest import saved_with_tiny_tokenizer
from tests.families.catalog import BY_NAME, FAMILIES, table
from tests.packing.samples import sample
from tests.serve.test_engine import random_prompt, run
from tests.trainer.test_trainer import config, logged, small_dataset, varied_reward

pytestmark = pytest.mark.families
NAMES = [family.name for family in FAMILIES]
TEMPERATURE = 0.8


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Each family's model saved with the tiny tokenizer, built on first use."""

    class Folders(dict):
        def __missing__(self, name):
            self[name] = saved_with_tiny_tokenizer(
                BY_NAME[name].build(), tmp_path_factory.mktemp(name.replace(" ", "_"))
            )
            return self[name]

    return Folders()


def trainer_model(folder: str, **settings):
    """The model as the trainer loads it (oneDNN layers in fp32, the tree attention), and its row layout."""
    _, model, layout = load_model(folder, AsyncGRPOConfig(output_dir="unused", **settings))
    return model.eval(), layout


def plain_model(folder: str, name: str):
    auto = AutoModelForImageTextToText if BY_NAME[name].vision else AutoModelForCausalLM
    return auto.from_pretrained(folder, attn_implementation="eager").eval()


def groups(rng: random.Random) -> list[list]:
    """Two groups of completions, prompts longer than the sliding windows: (prompt, [completions])."""
    return [
        (random_prompt(rng, 30), [random_prompt(rng, n) for n in (6, 9, 4)]),
        (random_prompt(rng, 17), [random_prompt(rng, n) for n in (8, 3)]),
    ]


@pytest.mark.parametrize("name", NAMES)
def test_packed_logprobs_equal_each_samples_own_forward(folders, name):
    folder, family = folders[name], BY_NAME[name]
    model, layout = trainer_model(folder)
    assert layout == (PADDED if family.padded else TREE), f"{name} packs as {layout}"
    reference = plain_model(folder, name)
    samples, expected = [], []
    for group, (prompt, completions) in enumerate(groups(random.Random(0))):
        for completion in completions:
            ids = prompt + completion
            samples.append(sample(ids, [False] * len(prompt) + [True] * len(completion), group=group))
            with torch.no_grad():
                logits = reference(input_ids=torch.tensor([ids + [0] * max(0, 16 - len(ids))])).logits[0].float()
            expected.append(
                (logits[len(prompt) - 1 : len(ids) - 1] / TEMPERATURE)
                .log_softmax(-1)
                .gather(1, torch.tensor(completion)[:, None])[:, 0]
            )
    with torch.no_grad():
        got = row_log_probs(model, pack(samples, layout), "exact", TEMPERATURE).log_probs
    gap = (got - torch.cat(expected)).abs().max().item()
    assert gap < 2e-5, f"{name}: packed log-probs are {gap:.2e} from each sample's own forward"


@pytest.mark.parametrize("name", NAMES)
def test_exact_decoding_samples_the_log_probs_the_trainer_computes(folders, name):
    folder, family = folders[name], BY_NAME[name]
    model, layout = trainer_model(folder)
    engine = Engine(
        plain_model(folder, name), eos_token_id=2, max_model_len=256, logprobs_mode="processed_logprobs", exact=True
    )
    engine.start()
    rng = random.Random(1)
    requests = [
        EngineRequest(
            prompt=random_prompt(rng, length),
            n=n,
            params=SamplingParams(temperature=TEMPERATURE, max_tokens=10, seed=i),
        )
        for i, (length, n) in enumerate([(30, 3), (5, 1), (17, 2)])
    ]
    try:
        run(engine, requests, timeout=120)
    finally:
        engine.stop()
    gaps = []
    for group, request in enumerate(requests):
        samples = [
            sample(request.prompt + s.output, [False] * len(request.prompt) + [True] * len(s.output), group=group)
            for s in request.sequences
        ]
        with torch.no_grad():
            scored = row_log_probs(model, pack(samples, layout), "exact", TEMPERATURE).log_probs
        served = torch.tensor([lp for s in request.sequences for lp in s.logprobs])
        gaps.append((scored - served).abs().max().item())
    assert max(gaps) <= family.served_gap, f"{name}: served log-probs {max(gaps):.2e} from the trainer's"


def train(tmp_path, folder: str, peft_config=None, **overrides) -> list[dict]:
    """Two steps at staleness 0 through the embedded server; the metrics of each."""
    args = config(
        tmp_path,
        max_staleness=0,
        max_steps=2,
        num_generations=3,
        learning_rate=1e-3,
        temperature=TEMPERATURE,
        **overrides,
    )
    AsyncGRPOTrainer(folder, varied_reward, args=args, train_dataset=small_dataset(8), peft_config=peft_config).train()
    rows = [r for r in logged(tmp_path) if "sampling/importance_sampling_ratio/mean" in r]
    assert len(rows) == 2 and all(r["sample/staleness_max"] == 0 for r in rows)
    return rows


def on_policy(name: str, rows: list[dict], bound: float) -> None:
    for r in rows:
        gap = r["sampling/sampling_logp_difference/max"]
        assert gap <= bound, f"{name}: the trainer's log-probs are {gap:.2e} from the sampler's at staleness 0"


@pytest.mark.parametrize("name", NAMES)
def test_trains_on_policy_with_full_weights_and_gradient_checkpointing(tmp_path, folders, name):
    rows = train(tmp_path, folders[name], gradient_checkpointing=True)
    on_policy(name, rows, BY_NAME[name].served_gap)


@pytest.mark.parametrize("name", NAMES)
def test_a_lora_adapter_trains_and_syncs(tmp_path, folders, name):
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=BY_NAME[name].lora_targets, lora_dropout=0.0)
    rows = train(tmp_path, folders[name], peft_config=lora, weight_sync_check_atol=1e-4)
    assert all(r["weight_sync/served_logprob_gap"] <= 1e-4 for r in rows if "weight_sync/served_logprob_gap" in r)
    on_policy(name, rows, max(BY_NAME[name].served_gap, 1e-4))


def test_the_models_page_is_generated_from_the_matrix():
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "models.md"
    assert page.read_text() == table(), "docs/models.md is stale: python -m tests.families.catalog > docs/models.md"


@pytest.mark.parametrize("name", NAMES)
def test_bf16_autocast_trains_with_every_tree_kernel(folders, name):
    """`bf16: true` on CPU: the tree row's forward and backward under bf16 autocast, each kernel close to fp32."""
    model, layout = trainer_model(folders[name], bf16=True)
    samples = [
        sample(prompt + c, [False] * len(prompt) + [True] * len(c), group=g)
        for g, (prompt, completions) in enumerate(groups(random.Random(2)))
        for c in completions
    ]
    with torch.no_grad():
        full = row_log_probs(model, pack(samples, layout), "exact", TEMPERATURE).log_probs
    for kernel in ("exact", "sdpa") if layout == TREE else ("exact",):  # a padded row runs the model's own attention
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = row_log_probs(model, pack(samples, layout), kernel, TEMPERATURE).log_probs
        half.sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads), f"{name}, {kernel}: no finite gradients in bf16"
        assert (half - full).abs().max() < 0.1 * full.abs().max(), f"{name}, {kernel}: bf16 log-probs far from fp32"
