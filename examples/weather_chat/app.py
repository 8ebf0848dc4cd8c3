"""Weather chat: answers a question, calling a weather tool when the model asks for it,
and streams the final answer as the model writes it.

First the model decides, under a JSON schema, whether to call `get_weather`; if it does,
the app runs the tool and asks again with its result. The engine is an argument: the real
`sgl.AsyncEngine` in `main()`, a fake or the null-model engine in test_app.py.

    python examples/weather_chat/app.py "Do I need an umbrella in Paris today?"
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import sgl

SYSTEM = ('You can call one tool, get_weather(city). Reply with JSON only: {"tool": "get_weather", '
          '"arguments": {"city": "<the city>"}} to call it, or {"tool": "none", "arguments": {"city": ""}} '
          "if the question is not about the weather.")
CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "tool": {"enum": ["get_weather", "none"]},
        "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32}},
                      "required": ["city"], "additionalProperties": False},
    },
    "required": ["tool", "arguments"],
    "additionalProperties": False,
}
DECIDE = {"json_schema": json.dumps(CALL_SCHEMA), "max_new_tokens": 200, "temperature": 0}
ANSWER = {"max_new_tokens": 128, "temperature": 0}
FORECASTS = {"paris": (14, "light rain"), "tokyo": (22, "sunny"), "cairo": (31, "clear")}


class ChatEngine(Protocol):
    """What the app needs of an engine: `sgl.AsyncEngine`'s tokenizer and stream."""

    @property
    def tokenizer(self) -> Any: ...

    def stream(self, prompt: str, sampling_params: dict[str, Any]) -> AsyncIterator[dict[str, Any]]: ...


class ChatError(Exception):
    """The question got no complete answer: the engine died, was busy, cut the answer
    short, or went quiet for longer than the timeout."""


@dataclass
class Reply:
    text: str
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # {"city": ..., "result": ...} per call


def get_weather(city: str) -> dict[str, Any]:
    """The tool: a stand-in forecast (a real app asks a weather service)."""
    celsius, sky = FORECASTS.get(city.strip().lower(), (18, "cloudy"))
    return {"city": city, "celsius": celsius, "sky": sky}


async def ask(engine: ChatEngine, question: str, *, weather: Callable[[str], dict[str, Any]] = get_weather,
              on_text: Callable[[str], None] = lambda piece: None, timeout_s: float = 30.0) -> Reply:
    """Answer `question`, passing each piece of the final answer to `on_text` as it comes.
    `weather` is the tool; `timeout_s` bounds every wait for a token. Raises ChatError
    when the engine fails."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    decision = await _complete(engine, messages, DECIDE, timeout_s)
    try:
        call = json.loads(decision)
    except ValueError:
        raise ChatError(f"the model's tool call was cut short: {decision!r}") from None
    reply = Reply("")
    if call["tool"] == "get_weather":
        result = weather(call["arguments"]["city"])
        reply.tool_calls.append({"city": call["arguments"]["city"], "result": result})
        messages += [{"role": "assistant", "content": decision},
                     {"role": "tool", "content": json.dumps(result)},
                     {"role": "user", "content": "Now answer my question in a sentence."}]
    reply.text = await _complete(engine, messages, ANSWER, timeout_s, on_text)
    return reply


async def _complete(engine: ChatEngine, messages: list[dict[str, str]], params: dict[str, Any], timeout_s: float,
                    on_text: Callable[[str], None] = lambda piece: None) -> str:
    """The model's answer to the chat, streamed: the whole text once it has finished."""
    prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chunks = engine.stream(prompt, params)
    pieces: list[str] = []
    finish: dict[str, Any] | None = None
    try:
        while True:
            # A timeout cancels the wait, which ends the stream: the engine aborts the request.
            try:
                chunk = await asyncio.wait_for(anext(chunks), timeout_s)
            except StopAsyncIteration:
                break
            on_text(chunk["text"])
            pieces.append(chunk["text"])
            finish = chunk["meta_info"]["finish_reason"]
    except asyncio.TimeoutError:
        raise ChatError(f"the model sent nothing for {timeout_s} s") from None
    except (sgl.EngineDeadError, sgl.ServerBusyError) as e:
        raise ChatError(str(e)) from e
    if finish is not None and finish["type"] == "abort":
        raise ChatError(f"the answer was cut short: {finish['message']}")
    return "".join(pieces)


async def main(question: str) -> int:
    async with await sgl.AsyncEngine.start() as engine:  # the default model, SmolLM2-135M-Instruct
        try:
            reply = await ask(engine, question, on_text=lambda piece: print(piece, end="", flush=True))
        except ChatError as e:
            print(f"\nno answer: {e}", file=sys.stderr)
            return 1
    print()
    for call in reply.tool_calls:
        print(f"(called get_weather({call['city']!r}): {call['result']})")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(" ".join(sys.argv[1:]) or "What's the weather like in Paris?")))
