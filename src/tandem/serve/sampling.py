"""Sampling parameters and the processed distribution every generated token is drawn from.

The order follows vLLM's sampler (`vllm/v1/sample/sampler.py`): penalties and min_tokens masking,
then ÷temperature, then min_p, then top-k, then top-p. The log-softmax of the result is what
`--logprobs-mode processed_logprobs` returns, so the trainer's importance ratio divides by the exact
probability the token was sampled with. Tokens outside the kept support get -inf.
"""

from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-5
LOGPROB_FLOOR = -9999.0
"""vLLM floors -inf log-probs to this value in JSON."""


@dataclass
class SamplingParams:
    """One sequence's sampling settings (vLLM's SamplingParams subset that tandem serve implements)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    """Added to the logits before the penalties and the temperature."""
    allowed_token_ids: list[int] | None = None
    """Every other token's logit is -inf."""
    bad_words: list[list[int]] = field(default_factory=list)
    """Token sequences never completed: a sequence's last token is banned after the rest of it was generated."""
    logprob_token_ids: list[int] | None = None
    """The tokens whose log-probs each position reports (with the sampled one), in place of the top-k."""
    repetition_detection: tuple[int, int, int] | None = None
    """(min_pattern_size, max_pattern_size, min_count): stop ("repetition") once the output's last L tokens, for some
    L in the range, repeat min_count times in a row."""

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def apply_masks(logits: torch.Tensor, params: SamplingParams, output: list[int], min_tokens_blocked: set[int]) -> None:
    """vLLM's masks and bias on one row, in its order, in place: allowed tokens, bad words, min_tokens, logit bias."""
    if params.allowed_token_ids is not None:
        keep = logits[params.allowed_token_ids].clone()
        logits.fill_(float("-inf"))
        logits[params.allowed_token_ids] = keep
    for word in params.bad_words:
        if len(word) == 1 or (len(word) <= len(output) + 1 and output[len(output) - len(word) + 1 :] == word[:-1]):
            logits[word[-1]] = float("-inf")
    if min_tokens_blocked:
        logits[sorted(min_tokens_blocked)] = float("-inf")
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), device=logits.device, dtype=logits.dtype)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Repetition (prompt and output tokens), presence and frequency (output tokens) penalties, in place."""
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long, device=logits.device)
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if output and (params.presence_penalty or params.frequency_penalty):
        ids, counts = torch.tensor(output, device=logits.device).unique(return_counts=True)
        logits[ids] -= params.frequency_penalty * counts.to(logits.dtype) + params.presence_penalty
    return logits


def process_logits(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, min_p, top-k and top-p for a batch of rows: [B, V] logits -> processed logits.

    Greedy rows (temperature ~0) are left unscaled and unmasked, as in vLLM.
    """
    device = logits.device
    temperature = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device, dtype=logits.dtype)
    logits = logits / temperature[:, None]

    min_p = torch.tensor([0.0 if p.greedy else p.min_p for p in params], device=device, dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = logits.softmax(-1)
        too_small = probs < min_p[:, None] * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(too_small, float("-inf"))

    top_k = torch.tensor([0 if p.greedy or p.top_k <= 0 else p.top_k for p in params], device=device)
    top_p = torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=device, dtype=logits.dtype)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        logits = _top_k_top_p(logits, top_k, top_p)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's rule: keep the k largest (ties at the k-th value kept), then the smallest top set of mass >= p."""
    vocab = logits.shape[-1]
    ascending, order = logits.sort(dim=-1)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth_value = ascending.gather(-1, (vocab - k)[:, None])
    ascending = ascending.masked_fill(ascending < kth_value, float("-inf"))
    cumulative = ascending.softmax(-1).cumsum(-1)
    drop = cumulative <= (1 - top_p)[:, None]
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ascending)


def sample(processed: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row from its processed logits, with the row's own generator (argmax when greedy).

    Inverse-CDF sampling, batched: each row draws one uniform u from its generator and takes the first token whose
    cumulative probability exceeds u × total, so token i is drawn with probability p_i and a zero-probability token
    (an empty step of the CDF) never. Only the draws are per row; one cumsum and search serve the batch."""
    cdf = processed.softmax(-1).cumsum(-1)
    total = cdf[:, -1:]
    if not bool(torch.isfinite(total).all()):
        raise RuntimeError("sampling: a row's probabilities are not finite (the model's logits hold NaN or infinity)")
    uniform = torch.stack([torch.rand((), generator=generator) for generator in generators]).to(cdf.device)
    point = torch.minimum(uniform[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # below the top
    tokens = torch.searchsorted(cdf, point, right=True)[:, 0]
    greedy = torch.tensor([p.greedy for p in params], device=processed.device)
    return torch.where(greedy, processed.argmax(-1), tokens)


def floor_logprob(value: float) -> float:
    """JSON-safe log-prob: -inf (and anything below) becomes -9999.0."""
    return max(value, LOGPROB_FLOOR)
