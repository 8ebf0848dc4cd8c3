"""A request body declared as something other than JSON is a 415 in OpenAI's error
shape, as FastAPI servers (SGLang, vLLM) refuse it; JSON media types and a missing
Content-Type are read as JSON. No server: the check on a bare Starlette request
(the whole route: tests/test_openai_conformance_more.py::test_bad_json_and_content_type)."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from sgl.server.common import ApiError, check_content_type


def request(content_type: str | None) -> Request:
    headers = [] if content_type is None else [(b"content-type", content_type.encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})


@pytest.mark.parametrize("content_type", [None, "", "application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_bodies_pass(content_type: str | None) -> None:
    check_content_type(request(content_type))


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                                          "text/plain"])
def test_other_bodies_are_a_415(content_type: str) -> None:
    with pytest.raises(ApiError) as e:
        check_content_type(request(content_type))
    assert e.value.status == 415 and e.value.body()["error"]["type"] == "invalid_request_error"
    assert content_type.split(";")[0] in e.value.message
