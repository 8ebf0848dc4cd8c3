"""What tests/test_openai_conformance.py and tests/test_openai_conformance_more.py share: the
served name, the server they share (tests/conftest.py's session fixture `peer_server`:
the default model, real weights in float32; each test checks KV balances after it,
so none leaves state behind), the tokenizer, and short-hands for the openai client's calls."""

from __future__ import annotations

import functools
import json
from typing import Any

import openai

from tests.serve_util import ServerProc

MODEL = "smol-peer"
API_KEY = "sk-peer"
NAME_PROMPT = "Hello, my name is"  # greedy: " Alex, and I'm a professional coach" (no EOS for 8+ tokens)
EOS_PROMPT = "What is an LLM?"  # greedy: EOS first
CHAT = [{"role": "system", "content": "you are a helpful assistant"}, {"role": "user", "content": "what is 1+1?"}]


def start_server() -> ServerProc:
    from sgl.sched.models.default_model import default_model_dir

    return ServerProc("--model-path", default_model_dir(), "--dtype", "float32", "--max-total-tokens", "4000",
                      "--served-model-name", MODEL, api_key=API_KEY)


@functools.cache
def tokenizer() -> Any:
    from sgl.sched.models.default_model import default_model_dir
    from sgl.sched.models.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir())


def cmpl(oai: openai.OpenAI, **kw: Any) -> Any:
    return oai.completions.create(model=MODEL, **{"prompt": NAME_PROMPT, "temperature": 0, **kw})


def chat(oai: openai.OpenAI, **kw: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, **{"messages": CHAT, "temperature": 0, **kw})


def sse_events(text: str) -> list[dict[str, Any]]:
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]
