"""A streamed token whose text holds a character ``str.splitlines`` ends a line at (U+0085, U+2028,
U+2029) reaches a client that reads the stream with httpx's ``iter_lines`` whole: every event's
JSON parses, and the text is the model's, those characters included."""

from __future__ import annotations

import json

import httpx
import pytest

from hetserve.serve.fake import ByteCodec, FakeBackend

LINE_ENDS = {"a": "\u2028", "b": "\x85", "c": "\u2029"}


class _LineEndCodec(ByteCodec):
    """The fake's letters a, b and c decode to Unicode line ends."""

    def decode(self, ids) -> str:
        return "".join(LINE_ENDS.get(ch, ch) for ch in super().decode(ids))


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_unicode_line_ends_in_tokens_do_not_split_an_event(serve_fake, endpoint):
    url, _, _ = serve_fake(FakeBackend(), codec=_LineEndCodec())
    path, body = (("/v1/completions", {"prompt": "hi"}) if endpoint == "completions" else
                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}))
    body.update(model="tiny", max_tokens=6, seed=0, stream=True)  # seed 0: the letters a, b, c, d, e, f
    with httpx.stream("POST", url + path, json=body, timeout=20) as resp:
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    text = "".join(choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                   for e in events for choice in e["choices"])
    assert text == "\u2028\x85\u2029def"
