"""The batching engine: log-prob fidelity, determinism, stopping, aborts, alone and inside busy batches."""

import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.kernels import exact_attention
from tandem.serve.engine import Engine
from tandem.serve.requests import EngineRequest
from tandem.serve.sampling import SamplingParams
from tandem.tasks import TINY_MODEL_PATH

TOLERANCE = 0.0 if exact_attention.ROWS_ROUND_ALIKE else 1e-5
"""Bit for bit where MKL's strict mode makes every row of a matmul round alike."""

SETTINGS = {
    "temperature 0.7": SamplingParams(temperature=0.7),
    "temperature 1.0": SamplingParams(temperature=1.0),
    "top-k": SamplingParams(temperature=1.0, top_k=8),
    "top-p": SamplingParams(temperature=1.0, top_p=0.85),
    "min-p": SamplingParams(temperature=1.0, min_p=0.05),
}


def make_engine(attention: str = "eager", **kwargs) -> Engine:
    model = AutoModelForCausalLM.from_pretrained(
        TINY_MODEL_PATH, dtype=torch.float32, attn_implementation=attention
    ).eval()
    kwargs.setdefault("logprobs_mode", "processed_logprobs")
    kwargs.setdefault("exact", attention == "eager")
    kwargs.setdefault("max_model_len", 256)
    engine = Engine(model, eos_token_id=2, **kwargs)
    engine.start()
    return engine


@pytest.fixture(scope="module", params=[None, exact_attention.MIN_ROWS], ids=["probed rows", "padded rows"])
def engine(request):
    """Exact decoding as this machine runs it (MKL's strict mode: matmuls of the few rows MATMUL_ROWS probed), and
    with every matmul padded to 16 rows as on a torch without MKL."""
    e = make_engine()
    e.runner.min_rows = request.param or e.runner.min_rows
    yield e
    e.stop()


def run(engine: Engine, requests: list[EngineRequest], timeout: float = 60) -> None:
    for r in requests:
        engine.submit(r)
    wait(requests, timeout)


def wait(requests: list[EngineRequest], timeout: float = 60) -> None:
    until(lambda: all(r.finished for r in requests), timeout)


def until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "engine did not finish in time"
        time.sleep(0.002)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 384) for _ in range(length)]


def teacher_forced(model, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """Processed log-probs of `output` from one plain forward over prompt + output (no cache, no batching).

    Sequences shorter than 16 tokens are right-padded to 16: causal attention makes that a no-op for every
    real position, and it keeps the reference's own matmuls on the path every longer forward takes.
    """
    tokens = prompt + output + [0] * max(0, 16 - len(prompt) - len(output))
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float()
    scaled = logits / params.temperature
    if params.min_p > 0:
        probs = scaled.softmax(-1)
        scaled = scaled.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    if params.top_k > 0:
        kth = scaled.topk(params.top_k).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if params.top_p < 1:
        probs = scaled.softmax(-1)
        sorted_probs, order = probs.sort(-1)
        drop_sorted = sorted_probs.cumsum(-1) <= 1 - params.top_p
        drop_sorted[:, -1] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.log_softmax(-1)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_logprobs_equal_a_teacher_forced_forward_alone_and_in_a_busy_batch(engine, tiny_model, name):
    rng = random.Random(hash(name) % 1000)
    params = SETTINGS[name]
    alone = EngineRequest(
        prompt=random_prompt(rng, 11),
        params=SamplingParams(**{**params.__dict__, "max_tokens": 24, "seed": 5, "logprobs": 3}),
    )
    run(engine, [alone])
    busy = [
        EngineRequest(
            prompt=random_prompt(rng, rng.randrange(2, 40)),
            n=rng.choice([1, 3]),
            params=SamplingParams(**{**params.__dict__, "max_tokens": rng.randrange(4, 30), "seed": i, "logprobs": 3}),
        )
        for i in range(12)
    ]
    run(engine, busy)
    for request in [alone] + busy:
        for seq in request.sequences:
            expected = teacher_forced(tiny_model, request.prompt, seq.output, request.params)
            got = torch.tensor(seq.logprobs)
            picked = expected[torch.arange(len(seq.output)), torch.tensor(seq.output)]
            assert torch.allclose(got, picked, atol=TOLERANCE, rtol=0), (
                f"{name}: sampled-token log-probs drift by {(got - picked).abs().max():.2e}"
            )
            for position, entries in enumerate(seq.top_logprobs):
                for token, value, rank in entries:
                    reference = float(expected[position, token])
                    assert value == reference or abs(value - reference) <= TOLERANCE, (
                        f"{name}: top-N entry for token {token} differs"
                    )
                    assert rank == int((expected[position] > expected[position, token]).sum()) + 1


def test_rows_of_a_wide_matmul_round_alike_from_a_few_rows_on_under_the_mode_import_tandem_sets():
    """Exact decoding forwards a few rows a step, the trainer hundreds: MKL's strict mode (set by `import tandem`) keeps
    each row's sum in one order from MATMUL_ROWS rows on (probed at import). Without it, 2048-wide sums split over
    threads under ~512 rows (the engine's padding to 16 rows kept only layers under 1024 wide exact)."""
    if not torch.backends.mkl.is_available():
        pytest.skip("a torch without MKL: the engine pads every matmul to 16 rows instead")
    assert exact_attention.ROWS_ROUND_ALIKE, "MKL's strict mode is off in this process"
    assert exact_attention.MATMUL_ROWS < exact_attention.MIN_ROWS, "the strict mode should spare the padding to 16 rows"
    torch.manual_seed(0)
    weight, inputs = torch.randn(192, 2048) * 0.02, torch.randn(1024, 2048)
    long = torch.nn.functional.linear(inputs, weight)
    counts = [*range(exact_attention.MATMUL_ROWS, exact_attention.MIN_ROWS + 1), 64]
    drifted = [
        rows for rows in counts if not torch.equal(torch.nn.functional.linear(inputs[:rows], weight), long[:rows])
    ]
    assert not drifted, (
        f"rows round unlike a 1024-row matmul at {drifted} rows (MATMUL_ROWS {exact_attention.MATMUL_ROWS})"
    )


def test_the_same_seed_gives_the_same_tokens_alone_and_in_a_busy_batch(engine):
    rng = random.Random(7)
    prompt = random_prompt(rng, 9)
    params = SamplingParams(temperature=1.0, max_tokens=32, seed=1234)
    first, second = EngineRequest(prompt=prompt, params=params), EngineRequest(prompt=prompt, params=params)
    run(engine, [first])
    noise = [
        EngineRequest(prompt=random_prompt(rng, rng.randrange(2, 60)), params=SamplingParams(max_tokens=40))
        for _ in range(20)
    ]
    run(engine, noise[:10] + [second] + noise[10:])
    assert first.sequences[0].output == second.sequences[0].output


def test_children_of_a_seeded_request_use_seed_plus_index(engine):
    prompt = [1, 50, 60, 70]
    group = EngineRequest(prompt=prompt, params=SamplingParams(max_tokens=16, seed=100), n=3)
    third = EngineRequest(prompt=prompt, params=SamplingParams(max_tokens=16, seed=102))
    run(engine, [group, third])
    assert group.sequences[2].output == third.sequences[0].output
    assert len({tuple(s.output) for s in group.sequences}) > 1, "children must not all be identical"


def test_sampling_masks_list_exactly_the_kept_support(engine, tiny_model):
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.9, max_tokens=10, seed=3)
    request = EngineRequest(prompt=[1, 274, 205, 277], params=params, return_sampling_mask=True)
    run(engine, [request])
    seq = request.sequences[0]
    expected = teacher_forced(tiny_model, request.prompt, seq.output, params)
    for position, mask in enumerate(seq.sampling_masks):
        assert mask == torch.isfinite(expected[position]).nonzero().flatten().tolist()
        assert seq.output[position] in mask


def test_prompt_logprobs_are_raw_and_start_with_none(engine, tiny_model):
    prompt = [1, 274, 205, 277, 275, 227]
    request = EngineRequest(prompt=prompt, params=SamplingParams(max_tokens=2, prompt_logprobs=2))
    run(engine, [request])
    with torch.no_grad():
        reference = tiny_model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    assert request.prompt_logprobs[0] is None
    for j in range(1, len(prompt)):
        entry = request.prompt_logprobs[j]
        assert prompt[j] in entry
        assert abs(entry[prompt[j]][0] - float(reference[j - 1, prompt[j]])) < 1e-5


def test_stop_conditions_and_reasons(engine):
    base = dict(temperature=1.0, seed=0)
    length = EngineRequest(prompt=[1, 5, 6], params=SamplingParams(max_tokens=5, ignore_eos=True, **base))
    run(engine, [length])
    assert (length.sequences[0].finish_reason, len(length.sequences[0].output)) == ("length", 5)

    first_token = length.sequences[0].output[0]
    by_id = EngineRequest(prompt=[1, 5, 6], params=SamplingParams(max_tokens=5, stop_token_ids=[first_token], **base))
    run(engine, [by_id])
    assert by_id.sequences[0].output == [first_token]
    assert (by_id.sequences[0].finish_reason, by_id.sequences[0].stop_reason) == ("stop", first_token)

    min_tokens = EngineRequest(
        prompt=[1, 5, 6], params=SamplingParams(max_tokens=6, min_tokens=6, stop_token_ids=[first_token], **base)
    )
    run(engine, [min_tokens])
    assert first_token not in min_tokens.sequences[0].output[:5]


def test_context_length_ends_a_sequence_with_length():
    engine = make_engine()
    try:
        request = EngineRequest(prompt=list(range(3, 250)), params=SamplingParams(max_tokens=100, ignore_eos=True))
        run(engine, [request])
        assert len(request.prompt) + len(request.sequences[0].output) == 256
        assert request.sequences[0].finish_reason == "length"
    finally:
        engine.stop()


def test_the_kv_cache_holds_the_positions_its_sequences_reach_not_max_model_len():
    """Short sequences under a long max_model_len: the cache grows as far as they go (it once zeroed 1 GiB up front for
    512 rows of the tiny model), and what it held survives each growth (the tokens match a request run alone)."""
    engine = make_engine(max_model_len=1024)
    try:
        alone = EngineRequest(prompt=[1, 5, 6], params=SamplingParams(max_tokens=40, ignore_eos=True, seed=3))
        run(engine, [alone])
        assert engine.cache.kv.shape[4] == 64, "43 positions: the first growth, 64"
        requests = [EngineRequest(prompt=[1, 5, 6], params=SamplingParams(max_tokens=100, ignore_eos=True, seed=3))]
        requests += [
            EngineRequest(prompt=list(range(3, 3 + 20 * i)), params=SamplingParams(max_tokens=10)) for i in range(1, 6)
        ]
        run(engine, requests)
        assert engine.cache.kv.shape[4] == 128, "110 positions reached (a 100-token prompt): 64 doubled once"
        assert requests[0].sequences[0].output[:40] == alone.sequences[0].output, "the growth kept every row's keys"
    finally:
        engine.stop()


def test_abort_frees_the_slot_and_the_others_continue(engine):
    long = EngineRequest(prompt=[1, 9, 9], params=SamplingParams(max_tokens=200, ignore_eos=True))
    short = EngineRequest(prompt=[1, 8, 8], params=SamplingParams(max_tokens=30, ignore_eos=True, seed=4))
    engine.submit(long)
    engine.submit(short)
    time.sleep(0.05)
    engine.abort(long)
    wait([short])
    deadline = time.monotonic() + 10
    while not (long.finished and engine.idle()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert long.sequences[0].finish_reason == "abort"
    assert len(short.sequences[0].output) == 30
    assert engine.idle() and engine.stats().running == 0 and engine.stats().kv_used_tokens == 0


def test_requests_beyond_max_num_seqs_wait_for_a_free_slot():
    engine = make_engine(max_num_seqs=4)
    try:
        requests = [
            EngineRequest(prompt=[1, 7, i + 3], params=SamplingParams(max_tokens=8, ignore_eos=True)) for i in range(10)
        ]
        run(engine, requests)
        assert all(len(r.sequences[0].output) == 8 for r in requests)
        assert engine.stats().kv_capacity_tokens == 4 * 256
    finally:
        engine.stop()


def test_a_pause_stops_the_clock_of_a_simulated_slow_step():
    """`step_delay_s` stands in for a GPU's step: paused, that GPU computes nothing, so the wait left at the pause
    comes after the resume (a synchronous benchmark baseline would otherwise hide training inside it)."""
    engine = make_engine(step_delay_s=0.4)
    try:
        request = EngineRequest(prompt=[1, 7, 3], params=SamplingParams(max_tokens=4, ignore_eos=True))
        engine.submit(request)
        output = request.sequences[0].output
        until(lambda: len(output) >= 2)  # the first step prefills and decodes: its wait starts after its second token
        engine.set_paused(True)
        produced = len(output)
        time.sleep(0.6)  # longer than the step's whole wait
        assert len(output) == produced, "a paused engine decoded"
        engine.set_paused(False)
        resumed = time.monotonic()
        until(lambda: len(output) > produced)
        assert time.monotonic() - resumed >= 0.2, "the wait left at the pause was skipped: it ran while paused"
        wait([request])
    finally:
        engine.stop()


def test_a_stream_sees_only_checked_tokens_until_the_sequence_finishes(engine):
    """`checked` counts the tokens whose stop conditions were tested without ending the sequence: the token that
    completes a stop arrives only with `finish_reason`, so a stream never shows a stop string."""
    request = EngineRequest(
        prompt=[5, 6, 7],
        params=SamplingParams(max_tokens=40, seed=1, ignore_eos=True),
        stop_check=lambda out: "x" if len(out) == 6 else None,
    )
    seen = []
    request.notify = lambda: seen.append(
        (request.sequences[0].checked, len(request.sequences[0].output), request.finished)
    )
    run(engine, [request])
    running = [(checked, length) for checked, length, done in seen if not done]
    assert running and all(checked == length for checked, length in running)
    assert seen[-1] == (5, 6, True), "the stopping token is never counted as checked"


@pytest.mark.parametrize(
    "layers, message",
    [
        (
            {0: (2, 32, 32), 1: (2, 32, 32), 2: (1, 64, 64), 3: (2, 32, 32)},
            r"its layers store keys and values of differing shapes \(\[\(1, 64, 64\), \(2, 32, 32\)\]\)",
        ),
        ({0: (2, 32, 32), 1: (2, 32, 32)}, r"only layers \[0, 1\] store keys and values \(the others share them\)"),
    ],
    ids=["differing shapes", "shared across layers"],
)
def test_a_model_whose_layers_store_keys_and_values_unlike_each_other_is_refused_at_load_in_one_line(
    monkeypatch, layers, message
):
    """One KV tensor holds every layer alike; a model it cannot hold (layers of differing key-value heads or widths, or
    later layers reading an earlier layer's keys) is refused before serving, saying what to use instead."""
    from tandem.errors import UsageError
    from tandem.serve import engine as engine_module
    from tandem.serve.kv_cache import KVShapes

    shapes = KVShapes()
    shapes.layers = layers
    monkeypatch.setattr(engine_module, "kv_shapes", lambda model: shapes)
    model = AutoModelForCausalLM.from_pretrained(TINY_MODEL_PATH).eval()
    with pytest.raises(UsageError, match=rf"Qwen2ForCausalLM: {message}.*generate with vllm serve"):
        Engine(model, eos_token_id=2, max_model_len=64, exact=True)
