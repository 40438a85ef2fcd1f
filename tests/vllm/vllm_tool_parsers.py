"""Run inside vLLM's environment: read each reply with vLLM's own tool-call parser of a name, print the readings as JSON.

Usage: python vllm_tool_parsers.py TOKENIZER_FOLDER PARSER < replies.json  (a JSON list of strings)
"""

import json
import sys

from transformers import AutoTokenizer
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.tool_parsers import ToolParserManager

folder, name = sys.argv[1], sys.argv[2]
parser = ToolParserManager.get_tool_parser(name)(AutoTokenizer.from_pretrained(folder))
request = ChatCompletionRequest(messages=[], tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
readings = []
for reply in json.load(sys.stdin):
    info = parser.extract_tool_calls(reply, request)
    readings.append(
        {
            "called": info.tools_called,
            "content": info.content,
            "calls": [[call.function.name, call.function.arguments] for call in info.tool_calls],
        }
    )
print(json.dumps(readings))
