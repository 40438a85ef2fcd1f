"""`tandem proxy`: one vLLM-protocol endpoint in front of several generation servers."""
