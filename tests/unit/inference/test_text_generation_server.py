"""The REST server on a free local port, over real HTTP: `PUT /api`, the OpenAI routes (plain and streamed),
50 concurrent requests, and a battery of bad requests each answered with a 4xx while the server keeps serving.
Generations are greedy, so every answer is checked against the full-recompute reference."""
import http.client
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.unit.inference import tiny_gpt as T
from tests.unit.transformer.model_setup import init_single_rank, teardown_single_rank


@pytest.fixture(scope="module")
def server():
    from megatron.inference.text_generation_server import MegatronServer

    init_single_rank()
    model = T.build_model("llama")
    srv = MegatronServer(T.static_engine(model, tokenizer_=T.CharTokenizer()), max_request_bytes=4096)
    port = srv.start("127.0.0.1", 0)
    yield port, model
    srv.shutdown()
    teardown_single_rank()


def _request(port, method, path, body=None, raw=None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


def _expect(model, text, n):
    tok = T.CharTokenizer()
    return tok.detokenize(T.reference_greedy(model, tok.tokenize(text), n))


def _events(text):
    lines = [line[len("data: "):] for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_api_route(server):
    port, model = server
    prompts = ["Hello", "ab", "The quick brown"]
    status, text = _request(port, "PUT", "/api", {"prompts": prompts, "tokens_to_generate": 6, "top_k": 1,
                                                  "logprobs": True})
    assert status == 200, text
    body = json.loads(text)
    tok = T.CharTokenizer()
    for i, prompt in enumerate(prompts):
        generated = T.reference_greedy(model, tok.tokenize(prompt), 6)
        assert body["tokens"][i] == tok.tokenize(prompt) + generated
        assert body["text"][i] == prompt + tok.detokenize(generated)
        assert len(body["logprobs"][i]) == len(prompt) - 1 + len(generated)
        assert "".join(body["segments"][i]) == body["text"][i]
    status, text = _request(port, "PUT", "/api", {"prompts": ["xyz"], "tokens_to_generate": 0, "logprobs": True})
    assert status == 200 and json.loads(text)["text"] == ["xyz"] and len(json.loads(text)["logprobs"][0]) == 2


def test_openai_routes_and_streaming(server):
    port, model = server
    want = _expect(model, "Once upon", 8)
    status, text = _request(port, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 8, "temperature": 0})
    body = json.loads(text)
    assert status == 200 and body["object"] == "text_completion" and body["choices"][0]["text"] == want
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": len(want), "total_tokens": 9 + len(want)}
    status, text = _request(port, "POST", "/completions", {"prompt": ["Once upon", "ab"], "max_tokens": 8,
                                                           "temperature": 0, "echo": True, "logprobs": 2})
    choices = json.loads(text)["choices"]
    assert status == 200 and choices[0]["text"] == "Once upon" + want
    assert choices[1]["text"] == "ab" + _expect(model, "ab", 8)
    assert choices[0]["logprobs"]["token_logprobs"][0] is None and len(choices[0]["logprobs"]["tokens"]) == 9 + len(want)
    assert all(len(top) == 2 for top in choices[0]["logprobs"]["top_logprobs"][1:])
    if len(want) > 3:  # a stop string cuts the text
        stop = want[2:4]
        status, text = _request(port, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 8,
                                                                  "temperature": 0, "stop": stop})
        assert json.loads(text)["choices"][0]["text"] == want[:want.find(stop)]
    status, text = _request(port, "POST", "/v1/completions", {"prompt": "Once upon", "max_tokens": 8,
                                                              "temperature": 0, "stream": True})
    chunks = _events(text)
    assert status == 200 and len(chunks) >= 3 and "".join(c["choices"][0]["text"] for c in chunks) == want
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    chat_want = _expect(model, "system: be brief\nuser: hi\nassistant:", 7)
    status, text = _request(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 7,
                                                                   "temperature": 0})
    body = json.loads(text)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": chat_want}
    status, text = _request(port, "POST", "/v1/chat/completions", {"messages": messages, "max_tokens": 7,
                                                                   "temperature": 0, "stream": True})
    chunks = _events(text)
    assert chunks[0]["object"] == "chat.completion.chunk" and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == chat_want


def test_fifty_concurrent_requests(server):
    port, model = server
    prompts = [f"req {i} says" for i in range(50)]

    def call(i):
        if i % 2:
            status, text = _request(port, "PUT", "/api", {"prompts": [prompts[i]], "tokens_to_generate": 5, "top_k": 1})
            return status, json.loads(text)["text"][0][len(prompts[i]):]
        status, text = _request(port, "POST", "/v1/completions", {"prompt": prompts[i], "max_tokens": 5, "temperature": 0})
        return status, json.loads(text)["choices"][0]["text"]

    with ThreadPoolExecutor(max_workers=50) as pool:
        answers = list(pool.map(call, range(50)))
    assert answers == [(200, _expect(model, p, 5)) for p in prompts]


BAD_API = [
    {"prompts": "abc"}, {"prompts": []}, {"prompts": ["a"] * 129}, {"prompts": [1, 2]}, {"tokens_to_generate": 3},
    {"prompts": ["a"], "tokens_to_generate": -1}, {"prompts": ["a"], "tokens_to_generate": "5"},
    {"prompts": ["a"], "tokens_to_generate": 0}, {"prompts": ["a"], "temperature": 0.0},
    {"prompts": ["a"], "temperature": 101}, {"prompts": ["a"], "temperature": "hot"},
    {"prompts": ["a"], "top_k": 1001}, {"prompts": ["a"], "top_k": 2.5}, {"prompts": ["a"], "top_p": 1.5},
    {"prompts": ["a"], "top_p": 1}, {"prompts": ["a"], "top_p": 0.5, "top_k": 3},
    {"prompts": ["a"], "logprobs": "yes"}, {"prompts": ["a"], "max_len": 4}, {"sentences": ["a"]},
    {"prompts": ["a"], "top_p_decay": 0.5}, {"prompts": ["a"], "top_p": 0.5, "top_p_bound": 0.9},
    {"prompts": [""]}, {"prompts": ["a"], "random_seed": -5}, {"prompts": ["a"], "add_BOS": "no"},
    {"prompts": ["x" * 125], "tokens_to_generate": 10}, {"prompts": ["a"], "beam_width": 2},
    [1, 2], "prompts",
]
BAD_COMPLETIONS = [
    {"max_tokens": 3}, {"prompt": {"a": 1}, "max_tokens": 3}, {"prompt": [], "max_tokens": 3},
    {"prompt": "a", "max_tokens": -2}, {"prompt": "a", "max_tokens": 0}, {"prompt": "a", "n": 2},
    {"prompt": "a", "best_of": 3}, {"prompt": "a", "logprobs": 11}, {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]},
    {"prompt": "a", "stop": 5}, {"prompt": ["a", "b"], "stream": True}, {"prompt": "a", "temperature": -1},
    {"prompt": "a", "top_p": 0.5, "top_k": 2}, {"prompt": "a", "stream": "yes"}, {"prompt": [[1, 2], [500, "x"]]},
    {"prompt": "y" * 120, "max_tokens": 20}, {"prompt": [1, 999], "max_tokens": 2}, {"prompt": [[3], [-1]]},
]
BAD_CHAT = [
    {}, {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    port, model = server
    cases = [("PUT", "/api", json.dumps(b).encode()) for b in BAD_API]
    cases += [("POST", "/v1/completions", json.dumps(b).encode()) for b in BAD_COMPLETIONS]
    cases += [("POST", "/v1/chat/completions", json.dumps(b).encode()) for b in BAD_CHAT]
    cases += [("PUT", "/api", b"{not json"), ("PUT", "/api", b"\xff\xfe"), ("POST", "/v1/completions", b""),
              ("GET", "/api", None), ("POST", "/api", b"{}"), ("PUT", "/nowhere", b"{}"),
              ("PUT", "/api", json.dumps({"prompts": ["z" * 5000]}).encode())]
    for method, path, raw in cases:
        status, text = _request(port, method, path, raw=raw)
        assert 400 <= status < 500, (method, path, raw, status, text)
        assert "message" in json.loads(text)["error"], text
        assert _request(port, "GET", "/health")[0] == 200
    status, text = _request(port, "PUT", "/api", raw=b"{}", headers={"Content-Length": "99999999"})
    assert status == 413
    status, text = _request(port, "PUT", "/api", {"prompts": ["ok"], "tokens_to_generate": 4, "top_k": 1})
    assert status == 200 and json.loads(text)["text"] == ["ok" + _expect(model, "ok", 4)]
