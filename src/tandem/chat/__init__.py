"""Chat rendering and tool calls, the same for the server, the worker and the trainer: a conversation rendered to
token ids (`prompts.py`), tool schemas and the calls in a reply (`tool_calls.py`), and the tool-call formats of vLLM's
parsers (`tool_formats.py`)."""
