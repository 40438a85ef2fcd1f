"""`serve_throughput.py` on a random 76M-parameter model of the tiny model's architecture (hidden 768, 12 layers),
built at run time: `tandem serve` in both decode modes against vLLM's CPU build and `generate()` at 8 and 64
concurrent requests, at a size people serve.

    python benchmarks/serve_throughput_76m.py [serve_throughput.py's flags, which override these]
"""

import sys

import serve_throughput

if __name__ == "__main__":
    serve_throughput.main(["--model", "76m", "--concurrency", "8", "64", *sys.argv[1:]])
