import json

from ember_gateway.edge.errors import ApiError
from ember_gateway.edge.sse import DONE, SSE_HEADERS, sse_event


def test_event_is_one_data_line_and_a_blank_line():
    event = sse_event({"text": "a\nb", "n": 1, "none": None})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n")
    assert event.count(b"\n") == 2  # newlines inside strings stay escaped
    assert json.loads(event[len(b"data: ") :]) == {"text": "a\nb", "n": 1, "none": None}


def test_non_ascii_text_is_utf8():
    assert json.loads(sse_event({"text": "ünï €"})[6:].decode()) == {"text": "ünï €"}


def test_done_and_headers():
    assert DONE == b"data: [DONE]\n\n"
    assert SSE_HEADERS["Content-Type"] == "text/event-stream"
    assert SSE_HEADERS["Cache-Control"] == "no-cache"


def test_error_event_has_the_openai_error_shape():
    error = ApiError(503, "engine gone", type="service_unavailable_error", code="engine_unavailable")
    payload = json.loads(sse_event(error.body())[6:])
    assert payload["error"] == {
        "message": "engine gone", "type": "service_unavailable_error", "param": None, "code": "engine_unavailable"
    }
