"""Trained tokens/s of forward+backward: tree packing vs padding-free packing vs padded batches.

The same samples each time: G=8 rollouts per prompt, prompts of several lengths (long shared prompts,
short completions: the case tree packing is for). Each method fills rows of at most `--token-budget`
tokens with the token-budget batcher (tree: shared prefixes stored once; padding-free: every sample
whole; padded: a [batch, longest] rectangle whose area stays under the budget), then runs forward +
backward of the log-probs of every trained token. Printed per prompt length: the packing ratio (tokens
before packing per forwarded token), trained tokens/s of each method and the speed-ups; the goal is a
tree speed-up over padding-free of at least 0.9 x the packing ratio where shared prefixes dominate.

    python benchmarks/packing.py [--model PATH|76m] [--prompt-lengths 64 256 512] [--groups 8] [--token-budget 2048]
                                 [--markdown PATH]
"""

import argparse
import random
import time

import torch
from tables import add_markdown_flag, emit, markdown_table
from transformers import AutoModelForCausalLM

from tandem.contract.records import Sample
from tandem.kernels import onednn_linear
from tandem.packing import tree_attention
from tandem.packing.batching import TokenBudgetBatcher
from tandem.packing.log_probs import chunked_log_probs, row_log_probs
from tandem.tasks import TINY_MODEL_PATH, scaled_tiny

G = 8


def workload(prompt_len: int, groups: int, min_completion: int, max_completion: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    samples = []
    for group in range(groups):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        for _ in range(G):
            completion = [rng.randrange(3, vocab) for _ in range(rng.randint(min_completion, max_completion))]
            ids = prompt + completion
            samples.append(
                Sample(
                    input_ids=ids,
                    trained=[False] * prompt_len + [True] * len(completion),
                    behavior_log_probs=[0.0] * len(ids),
                    advantage=1.0,
                    model_version=0,
                    group_id=group,
                    prompt_index=group,
                    group_samples=G,
                    rollout_id="",
                    created_at=0.0,
                )
            )
    return samples


def rows_of(samples, budget: int, share_prefixes: bool):
    batcher, rows = TokenBudgetBatcher(budget, share_prefixes=share_prefixes), []
    for s in samples:
        if not batcher.offer(s):
            rows += batcher.close()
            batcher.offer(s)
    return rows + batcher.close()


def padded_batches(samples, budget: int):
    batches, current = [], []
    for s in samples:
        longest = max([x.num_tokens for x in current + [s]])
        if current and longest * (len(current) + 1) > budget:
            batches.append(current)
            current = []
        current.append(s)
    return batches + [current]


def tree_step(model, rows, kernel) -> None:
    for row in rows:
        row_log_probs(model, row, kernel).log_probs.sum().backward()


def padded_step(model, batches) -> None:
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    for batch in batches:
        width = max(s.num_tokens for s in batch)
        ids = torch.tensor([s.input_ids + [0] * (width - s.num_tokens) for s in batch])
        mask = torch.tensor([[1] * s.num_tokens + [0] * (width - s.num_tokens) for s in batch])
        hidden = decoder(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        where = [(b, j - 1) for b, s in enumerate(batch) for j in range(1, s.num_tokens) if s.trained[j]]
        rows, cols = zip(*where)
        targets = torch.tensor([batch[b].input_ids[j + 1] for b, j in where])
        chunked_log_probs(hidden[list(rows), list(cols)], head, targets).log_probs.sum().backward()


def timed(step, repeats: int) -> float:
    step()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        step()
    return (time.perf_counter() - start) / repeats


def measure(models, kernels, prompt_len: int, args) -> list[list[str]]:
    """One prompt length: print a line per kernel as it finishes, and return the performance page's table's rows."""
    tree_model, padded_model = models
    samples = workload(prompt_len, args.groups, *args.completion, tree_model.config.get_text_config().vocab_size)
    trained = sum(s.num_trained for s in samples)
    tree, flat = rows_of(samples, args.token_budget, True), rows_of(samples, args.token_budget, False)
    batches = padded_batches(samples, args.token_budget)
    ratio = sum(s.num_tokens for s in samples) / sum(r.num_tokens for r in tree)
    padded = trained / timed(lambda: padded_step(padded_model, batches), args.repeats)
    table = []
    for kernel in kernels:
        rates = [
            trained / timed(lambda rows=rows, kernel=kernel: tree_step(tree_model, rows, kernel), args.repeats)
            for rows in (tree, flat)
        ]
        speedup = rates[0] / rates[1]
        print(
            f"{kernel:>6} {prompt_len:>6} {ratio:>6.2f} {f'{len(tree)}/{len(flat)}/{len(batches)}':>14} {rates[0]:>11.0f} "
            f"{rates[1]:>9.0f} {padded:>9.0f} {speedup:>7.2f}x {rates[0] / padded:>8.2f}x {speedup / ratio:>16.2f}",
            flush=True,
        )
        table.append(
            [
                kernel,
                str(prompt_len),
                f"{ratio:.2f}",
                f"{rates[0]:.0f}",
                f"{rates[1]:.0f}",
                f"{padded:.0f}",
                f"{speedup:.2f}x",
                f"{rates[0] / padded:.2f}x",
                f"{speedup / ratio:.2f}",
            ]
        )
    return table


def load(name: str, **kwargs) -> torch.nn.Module:
    """A model folder, or "76m": `scaled_tiny(768, 12)`."""
    if name == "76m":
        return scaled_tiny(768, 12, **kwargs)
    return AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, **kwargs)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=TINY_MODEL_PATH, help='a model folder, or "76m" (built at run time)')
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--completion", type=int, nargs=2, default=[16, 48], metavar=("MIN", "MAX"))
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--kernels",
        choices=tree_attention.KERNELS,
        nargs="+",
        help="tree attention kernels to run (default: exact and sdpa on CPU, flex and sdpa on GPU)",
    )
    add_markdown_flag(parser)
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tree_model = load(args.model).to(device)
    tree_attention.prepare(tree_model)
    padded_model = load(args.model, attn_implementation="sdpa").to(device)
    padded_model.load_state_dict(tree_model.state_dict())  # the same random weights
    if device.type == "cpu":  # large linear layers on oneDNN, as the trainer's load_model routes them
        for model in (tree_model, padded_model):
            onednn_linear.install(model, exact=True, reorder=False)
    kernels = args.kernels or [tree_attention.default_kernel(device), "sdpa"]
    print(
        f"model {args.model}  device {device}  token_budget {args.token_budget}  "
        f"{args.groups} groups x G={G}, completions {args.completion[0]}-{args.completion[1]} tokens"
    )
    print("padded: stock transformers SDPA on [batch, longest] batches; tree and padding-free: the tree kernel named")
    print(
        f"{'kernel':>6} {'prompt':>6} {'ratio':>6} {'rows t/pf/pad':>14} {'tree tok/s':>11} {'pad-free':>9} {'padded':>9} "
        f"{'tree/pf':>8} {'tree/pad':>9} {'(tree/pf)/ratio':>16}"
    )
    rows = [
        row
        for prompt_len in args.prompt_lengths
        for row in measure((tree_model, padded_model), kernels, prompt_len, args)
    ]
    emit(
        markdown_table(
            [
                "kernel",
                "prompt",
                "packing ratio",
                "tree (tok/s)",
                "padding-free (tok/s)",
                "padded (tok/s)",
                "tree / padding-free",
                "tree / padded",
                "(tree / padding-free) / ratio",
            ],
            "lrrrrrrrr",
            rows,
        ),
        args.markdown,
    )


if __name__ == "__main__":
    main()
