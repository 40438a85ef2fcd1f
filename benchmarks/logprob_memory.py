"""Peak memory of the log-prob step: chunked log-softmax vs materialising the full logits.

8k trained tokens, a 32k vocabulary: forward and backward of the trained tokens' log-probs (with the
entropy the trainer logs) from their hidden states through the LM head. Each variant runs in its own
process and reports what the step added to the peak: on GPU `torch.cuda.max_memory_allocated`, on CPU
the process's peak resident memory (ru_maxrss) over what it held before the step.

    python benchmarks/logprob_memory.py [--tokens 8192] [--vocab 32768] [--hidden 1024] [--chunk-size N] [--markdown PATH]

The chunk size defaults to the trainer's own (tandem.packing.log_probs.default_chunk_size: 512 at a 32k vocabulary).
"""

import argparse
import json
import resource
import subprocess
import sys

import torch
from tables import add_markdown_flag, emit, markdown_table

from tandem.packing.log_probs import chunked_log_probs, default_chunk_size


def full_logprobs(hidden, head, targets):
    """What a trainer without chunking does: logits for every trained token at once."""
    logits = head(hidden).float()
    all_logprobs = logits.log_softmax(-1)
    entropy = -(all_logprobs.exp() * all_logprobs).sum(-1).detach()
    return all_logprobs.gather(1, targets[:, None])[:, 0], entropy


def measure(variant: str, tokens: int, vocab: int, hidden_size: int, chunk_size: int) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden_size, vocab, bias=False, device=device)
    hidden = torch.randn(tokens, hidden_size, device=device, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), device=device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if variant == "full":
        logprobs, _ = full_logprobs(hidden, head, targets)
    else:
        logprobs = chunked_log_probs(hidden, head, targets, chunk_size=chunk_size).log_probs
    logprobs.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": variant, "device": device.type, "step_peak_bytes": peak - before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk-size", type=int, default=None, help="default: the trainer's for the vocabulary")
    add_markdown_flag(parser)
    parser.add_argument("--variant", choices=["full", "chunked"], help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args()
    args.chunk_size = args.chunk_size or default_chunk_size(args.vocab)
    shape = (args.tokens, args.vocab, args.hidden, args.chunk_size)
    if args.variant:
        print(json.dumps(measure(args.variant, *shape)))
        return

    results = {}
    for variant in ("full", "chunked"):
        child = subprocess.run(
            [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--tokens",
                str(args.tokens),
                "--vocab",
                str(args.vocab),
                "--hidden",
                str(args.hidden),
                "--chunk-size",
                str(args.chunk_size),
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        results[variant] = json.loads(child.stdout.strip().splitlines()[-1])
    logits_bytes = args.tokens * args.vocab * 4
    print(
        f"{args.tokens} trained tokens, vocab {args.vocab}, hidden {args.hidden}, chunks of {args.chunk_size}, "
        f"device {results['full']['device']}; one fp32 logits matrix = {logits_bytes / 2**20:.0f} MiB"
    )
    for variant, result in results.items():
        print(f"  {variant:>8}: step peak {result['step_peak_bytes'] / 2**20:8.0f} MiB")
    ratio = results["full"]["step_peak_bytes"] / max(results["chunked"]["step_peak_bytes"], 1)
    print(f"  chunked uses {ratio:.1f}x less memory than full-logit materialisation")
    emit(
        markdown_table(
            [
                "trained tokens",
                "vocabulary",
                "hidden size",
                "chunk",
                "full logits: step peak",
                "chunked: step peak",
                "full / chunked",
            ],
            "rrrrrrr",
            [
                [
                    str(args.tokens),
                    str(args.vocab),
                    str(args.hidden),
                    str(args.chunk_size),
                    f"{results['full']['step_peak_bytes'] / 2**20:.0f} MiB",
                    f"{results['chunked']['step_peak_bytes'] / 2**20:.0f} MiB",
                    f"{ratio:.1f}x",
                ]
            ],
        ),
        args.markdown,
    )


if __name__ == "__main__":
    main()
