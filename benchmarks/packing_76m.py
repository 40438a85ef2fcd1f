"""`packing.py` on a random 76M-parameter model of the tiny model's architecture (hidden 768, 12 layers), built at run
time: trained tokens/s of forward+backward with tree packing, each kernel, against padded batches, at a size people
train. Fewer samples than the tiny model's run (4 groups, prompts of 64 and 256 tokens, one timed pass after a warm-up),
so that it takes minutes on 2 cores.

    python benchmarks/packing_76m.py [packing.py's flags, which override these]
"""

import sys

import packing

if __name__ == "__main__":
    packing.main(["--model", "76m", "--prompt-lengths", "64", "256", "--groups", "4", "--repeats", "1", *sys.argv[1:]])
