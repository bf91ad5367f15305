"""Less common request fields of OpenAI's API, as its client sends them (fake engine): what is
accepted because it changes nothing here, and what is refused because it cannot be honoured."""

from __future__ import annotations

import openai
import pytest

CHAT = [{"role": "user", "content": "x"}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_choice_that_asks_for_a_tool_call_is_refused_naming_the_field(serve_fake, choice):
    url, backend, _ = serve_fake()
    with pytest.raises(openai.BadRequestError) as err:
        client(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, tool_choice=choice)
    assert err.value.param == "tool_choice" and "tool_choice" in err.value.message, err.value.message
    assert not backend.placed


@pytest.mark.parametrize("choice", ["none", "auto"])
def test_a_tool_choice_that_allows_a_plain_answer_is_served(serve_fake, choice):
    url, _, _ = serve_fake()
    r = client(url).chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, tool_choice=choice)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("obfuscation", [False, True])
def test_stream_options_include_obfuscation_is_accepted(serve_fake, obfuscation):
    url, _, _ = serve_fake()
    chunks = list(client(url).chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=3, stream=True,
        stream_options={"include_usage": True, "include_obfuscation": obfuscation}))
    assert chunks[-1].usage.completion_tokens == 3
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("path", ["completions", "chat"])
def test_top_p_zero_is_taken_as_openai_takes_it_greedy(serve_fake, path):
    # the nucleus of no probability mass is the most likely token alone: the engine decodes greedily
    url, backend, _ = serve_fake()
    c = client(url)
    if path == "chat":
        r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, top_p=0, temperature=1.5)
    else:
        r = c.completions.create(model="tiny", prompt="x", max_tokens=2, top_p=0, temperature=1.5)
    assert r.usage.completion_tokens == 2
    (params,) = backend.params.values()
    assert (params.temperature, params.top_p) == (0.0, 1.0)
    with pytest.raises(openai.BadRequestError) as err:
        c.completions.create(model="tiny", prompt="x", max_tokens=2, top_p=-0.1)
    assert err.value.param == "top_p"
