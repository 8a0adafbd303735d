"""The OpenAI-compatible server end to end: a real uvicorn on 127.0.0.1, the official
`openai` client, a tiny random-weight Qwen2 checkpoint. One server for the module."""

from __future__ import annotations

import gc
import json
import threading

import httpx
import openai
import pytest

from portaserve.framework.config import EngineConfig
from portaserve.framework.server.state import ServerSettings
from server_harness import ServerThread, metric, wait_for

KEY = "test-key"
MAX_MODEL_LEN = 128
BODY_LIMIT = 64 * 1024
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from portaserve.models.checkpoints import write_checkpoint

    return write_checkpoint("Qwen2ForCausalLM", "tiny", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def srv(ckpt):
    config = EngineConfig.create(model=str(ckpt), max_model_len=MAX_MODEL_LEN, max_num_seqs=16, served_model_name="tiny")
    settings = ServerSettings(api_keys=(KEY,), enable_request_id_headers=True, max_request_body_bytes=BODY_LIMIT,
                              allowed_origins=("http://example.test",))
    with ServerThread(config, settings) as server:
        yield server


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, headers=AUTH, timeout=120) as c:
        yield c


MESSAGES = [{"role": "user", "content": "Hello there"}]


def tokenize_chat(http, messages=MESSAGES):
    return http.post("/tokenize", json={"messages": messages}).json()


# ----- models, chat, completions ---------------------------------------------------------------------


def test_models(client, ckpt):
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    card = models[0].model_dump()
    assert card["owned_by"] == "portaserve"
    assert card["max_model_len"] == MAX_MODEL_LEN
    assert card["root"] == str(ckpt)
    assert card["weights_version"] == 0
    assert card["demo"] is False


def test_chat_stream_equals_non_stream_with_exact_usage(client, http):
    prompt_ids = tokenize_chat(http)["tokens"]
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True)
    choice = full.choices[0]
    assert choice.finish_reason == "length"
    assert full.usage.prompt_tokens == len(prompt_ids)
    assert full.usage.completion_tokens == 6 == len(choice.logprobs.content)
    assert full.usage.total_tokens == len(prompt_ids) + 6
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"

    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)
    # the same prompt again: its full blocks come from the prefix cache, and usage says so
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(prompt_ids) - 1) // 16 * 16
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats(client):
    chunks = list(client.completions.create(model="tiny", prompt="count", max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_text = [c for c in chunks if c.choices]
    assert [c.usage.completion_tokens for c in with_text] == [1, 2, 3, 4]
    assert all(c.usage.prompt_tokens == 1 for c in chunks)
    assert chunks[-1].usage.total_tokens == 5


def test_completions_stream_and_echo(client, http):
    full = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=5, temperature=0)
    assert full.object == "text_completion" and full.usage.completion_tokens == 5
    n_prompt = len(http.post("/tokenize", json={"prompt": "The capital of France is"}).json()["tokens"])
    assert full.usage.prompt_tokens == n_prompt
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="The capital of France is", max_tokens=5, temperature=0, stream=True))
    assert streamed == full.choices[0].text
    echoed = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=5, temperature=0, echo=True)
    assert echoed.choices[0].text == "The capital of France is" + full.choices[0].text


def test_completion_logprobs_match_transformers(client, ckpt):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    prompt_ids = [9707, 11, 1879, 374, 264]
    out = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"return_tokens_as_token_ids": True})
    lp = out.choices[0].logprobs
    generated = [int(t.split(":")[1]) for t in lp.tokens]
    assert len(generated) == 6 and len(lp.token_logprobs) == 6
    model = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + generated])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for j, tok in enumerate(generated):
        row = ref[len(prompt_ids) + j - 1]
        assert tok == int(row.argmax())  # greedy
        assert lp.token_logprobs[j] == pytest.approx(float(row[tok]), abs=2e-3)
        top3 = {f"token_id:{int(i)}": float(row[i]) for i in row.topk(3).indices}
        assert set(lp.top_logprobs[j]) == set(top3)
        for k, v in top3.items():
            assert lp.top_logprobs[j][k] == pytest.approx(v, abs=2e-3)
    assert lp.text_offset == sorted(lp.text_offset)


def test_chat_top_logprobs_shape(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0, logprobs=True,
                                       top_logprobs=4)
    for entry in r.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 4
        assert entry.top_logprobs[0].token == entry.token  # greedy: the sampled token is the most likely
        assert entry.bytes == list(entry.token.encode("utf-8"))
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)


def test_n_and_seed(client):
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=8, temperature=1.0, n=2, seed=1234)
    a = client.chat.completions.create(**kwargs)
    b = client.chat.completions.create(**kwargs)
    assert [c.index for c in a.choices] == [0, 1]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]  # seeded: reproducible
    assert texts[0] != texts[1]  # n samples differ
    assert a.usage.completion_tokens == 16
    c = client.chat.completions.create(**{**kwargs, "seed": 99})
    assert [x.message.content for x in c.choices] != texts
    streamed = {0: "", 1: ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for ch in chunk.choices:
            streamed[ch.index] += ch.delta.content or ""
    assert [streamed[0], streamed[1]] == texts


def test_stop_strings(client):
    base = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0).choices[0].text
    stop = base[len(base) // 2: len(base) // 2 + 3]
    assert stop.strip(), base
    cut = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop])
    choice = cut.choices[0]
    assert choice.text == base[: base.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_dump()["stop_reason"] == stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=12, temperature=0, stop=[stop], stream=True) if c.choices)
    assert streamed == choice.text


def test_tokenize_detokenize_round_trip(http):
    text = "Hello, world! Ünïcödé 你好"
    tok = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == MAX_MODEL_LEN
    assert len(tok["token_strs"]) == tok["count"]
    assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json() == {"prompt": text}
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert "<|im_start|>assistant" in http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    bad = http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_native_generate(http, client):
    ids = [9707, 11, 1879, 374]
    body = {"token_ids": ids, "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 1}}
    r = http.post("/inference/v1/generate", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    assert len(choice["token_ids"]) == 5 and choice["finish_reason"] == "length"
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert data["usage"]["prompt_tokens"] == 4
    ref = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert [int(t.split(":")[1]) for t in ref.choices[0].logprobs.tokens] == choice["token_ids"]
    # streamed: the same ids, in deltas
    got = []
    with http.stream("POST", "/inference/v1/generate", json={**body, "stream": True, "request_id": "rl-1"}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert event["request_id"] == "rl-1"
                for c in event["choices"]:
                    got += c["token_ids"]
    assert got == choice["token_ids"]
    bad = http.post("/inference/v1/generate", json={"token_ids": ids, "sampling_params": {"beam_width": 2}})
    assert bad.status_code == 400 and "beam_width" in bad.json()["error"]["message"]


def test_request_id_header_and_cors(http, srv):
    r = http.get("/v1/models", headers={"X-Request-Id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    assert len(http.get("/v1/models").headers["x-request-id"]) == 32
    r = http.post("/v1/chat/completions", headers={"X-Request-Id": "abc"},
                  json={"messages": MESSAGES, "max_tokens": 1})
    assert r.json()["id"] == "chatcmpl-abc" and r.headers["x-request-id"] == "abc"
    pre = httpx.options(srv.url + "/v1/chat/completions", headers={
        "Origin": "http://example.test", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://example.test"
    other = httpx.options(srv.url + "/v1/models", headers={"Origin": "http://evil.test", "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in other.headers


def test_version_and_health(srv):
    assert httpx.get(srv.url + "/health").status_code == 200  # no key needed
    assert httpx.get(srv.url + "/version", headers=AUTH).json()["version"]


# ----- errors ---------------------------------------------------------------------------------------


def error_of(response, status):
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    assert "Traceback" not in err["message"]
    return err


ROUTES = [
    ("GET", "/v1/models", None), ("GET", "/version", None), ("GET", "/metrics", None),
    ("POST", "/v1/chat/completions", {"messages": MESSAGES}), ("POST", "/v1/completions", {"prompt": "x"}),
    ("POST", "/v1/embeddings", {"input": "x"}), ("POST", "/tokenize", {"prompt": "x"}),
    ("POST", "/detokenize", {"tokens": [1]}), ("POST", "/inference/v1/generate", {"token_ids": [1]}),
]


@pytest.mark.parametrize("method,path,body", ROUTES)
@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}])
def test_401_everywhere_but_health(srv, method, path, body, headers):
    r = httpx.request(method, srv.url + path, json=body, headers=headers)
    err = error_of(r, 401)
    assert err["type"] == "AuthenticationError"


def test_openai_client_wrong_key(srv):
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_400_pydantic_remapped(http):
    err = error_of(http.post("/v1/chat/completions", json={"messages": "not a list"}), 400)
    assert err["param"] == "messages" and err["type"] == "BadRequestError"
    err = error_of(http.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": "hot"}), 400)
    assert err["param"] == "temperature"
    err = error_of(http.post("/v1/completions", json={}), 400)
    assert err["param"] == "prompt" and "required" in err["message"]
    err = error_of(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]


@pytest.mark.parametrize("body,param,words", [
    ({"temperature": -1}, "temperature", ["[0, 10000]"]),
    # found by the fuzzer: a float32 overflow that made every logit NaN
    ({"temperature": 8.363097814439642e307}, "temperature", ["[0, 10000]"]),
    ({"repetition_penalty": 1e300}, "repetition_penalty", ["[0.0001, 10000]"]),
    # found by the fuzzer: divides positive logits into inf, so nothing finite is left to sample
    ({"repetition_penalty": 2.2898275114603206e-152, "allowed_token_ids": [5, 6]}, "repetition_penalty", ["[0.0001, 10000]"]),
    ({"seed": 2**70}, "seed", ["2^64"]),
    ({"top_p": 0}, "top_p", ["(0, 1]"]),
    ({"n": 0}, "n", [">= 1"]),
    ({"max_tokens": 10_000}, "max_tokens", ["10000", str(MAX_MODEL_LEN)]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", ["JSON schema is invalid", "type"]),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", ["schema is required"]),
    ({"response_format": {"type": "regex"}}, "response_format", ["structured_outputs"]),
    ({"structured_outputs": {"regex": "(open"}}, "structured_outputs", ["parenthesis"]),
    ({"structured_outputs": {"json": {"type": "object"}, "regex": "a"}}, "structured_outputs", ["exactly one"]),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", ["only one constraint"]),
    ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", ["EBNF"]),
    ({"structured_outputs": {"choice": ["x"] * 2000}}, "structured_outputs", ["1024"]),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice",
     ["--enable-auto-tool-choice"]),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}],
      "response_format": {"type": "json_object"}}, "tool_choice", ["cannot be combined", "response_format"]),
    ({"chat_template": "{{ messages }}"}, "chat_template", ["--trust-request-chat-template"]),
    ({"logprobs": True, "top_logprobs": 50}, "logprobs", ["20"]),
    ({"priority": 3}, "priority", ["--scheduling-policy priority"]),
    ({"use_beam_search": True}, "use_beam_search", ["beam search"]),
    ({"logit_bias": {"99999999": 5}}, "logit_bias", ["99999999", "vocabulary"]),
    ({"stop_token_ids": [-1]}, "stop_token_ids", [">= 0"]),
    ({"messages": []}, "messages", ["at least 1"]),
])
def test_400_invalid_parameters(http, body, param, words):
    err = error_of(http.post("/v1/chat/completions", json={"messages": MESSAGES, **body}), 400)
    assert err["param"] == param
    for w in words:
        assert w in err["message"]


def test_400_prompt_too_long_names_the_limit(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * (MAX_MODEL_LEN + 10), max_tokens=1)
    assert str(MAX_MODEL_LEN) in str(info.value) and str(MAX_MODEL_LEN + 10) in str(info.value)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="tiny", prompt=[5] * 100, max_tokens=50)


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1, "metadata": {"a": 1},
                                                 "store": False, "some_future_field": 3})
    assert r.status_code == 200, r.text


def test_404_unknown_model_and_route(client, http):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-5", messages=MESSAGES)
    err = error_of(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
    assert err["param"] == "model"
    error_of(http.get("/v1/nothing-here"), 404)


def test_413_body_over_limit(http):
    big = {"prompt": "x" * (BODY_LIMIT + 10)}
    err = error_of(http.post("/v1/completions", json=big), 413)
    assert str(BODY_LIMIT) in err["message"]

    def chunked():  # no Content-Length: counted while reading
        for _ in range(20):
            yield b"x" * 8192

    r = http.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    error_of(r, 413)


def test_embeddings_on_a_generative_model_is_400(http):
    err = error_of(http.post("/v1/embeddings", json={"input": "hi"}), 400)
    assert "embedding" in err["message"]


def test_mid_stream_failure_is_an_sse_error_event(client, srv, monkeypatch):
    from portaserve.framework.server import serving_chat

    real = serving_chat.ChoiceParser.delta
    calls = {"n": 0}

    def failing(self, text, final):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in the parser")
        return real(self, text, final)

    monkeypatch.setattr(serving_chat.ChoiceParser, "delta", failing)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=50, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    got = []
    with pytest.raises(openai.APIError, match="boom in the parser") as info:
        for chunk in stream:
            got.append(chunk)
    assert got  # the failure came after chunks were sent
    assert "Traceback" not in str(info.value)
    monkeypatch.setattr(serving_chat.ChoiceParser, "delta", real)
    assert wait_for(lambda: srv.engine.latest_stats.num_running == 0, 20)


# ----- disconnects and metrics -------------------------------------------------------------------------


def scrape(http) -> str:
    r = http.get("/metrics")
    assert r.status_code == 200
    return r.text


def test_dropped_streams_abort_and_free_blocks(srv, http):
    # With the cyclic garbage collector off, nothing is cleaned up by collection: the
    # handlers must close their engine iterators themselves (a leak otherwise).
    gc.disable()
    try:
        _drop_streams_and_check(srv, http)
    finally:
        gc.enable()


def _drop_streams_and_check(srv, http):
    before = metric(scrape(http), "portaserve:request_success_total", finished_reason="abort")
    num_streams = 12
    problems: list[str] = []

    def drop_one(i: int) -> None:
        body = {"model": "tiny", "messages": [{"role": "user", "content": f"stream {i}"}], "max_tokens": 80,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    problems.append(f"{resp.status_code}: {resp.read()!r}")
                    return
                for line in resp.iter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        return  # tokens are flowing: go away mid-stream
                problems.append("the stream ended before any token")

    threads = [threading.Thread(target=drop_one, args=(i,)) for i in range(num_streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not problems
    engine = srv.engine

    def settled() -> bool:
        # a handler notices its client is gone at its next write, so the last aborts can
        # trail the joins by a step or two: wait for every sign together
        stats = engine.latest_stats
        return (stats.num_running == 0 and stats.num_waiting == 0 and engine.num_in_flight() == 0
                and metric(scrape(http), "portaserve:request_success_total", finished_reason="abort") - before == num_streams)

    assert wait_for(settled, 30), (engine.latest_stats, engine.num_in_flight())
    stats = engine.latest_stats
    assert stats.kv_cache_usage == 0.0 and stats.num_free_blocks == stats.num_total_blocks
    text = scrape(http)
    assert metric(text, "portaserve:num_requests_running") == 0
    assert metric(text, "portaserve:kv_cache_usage_perc") == 0
    assert metric(text, "portaserve:request_success_total", finished_reason="abort") - before == num_streams


def test_dropped_non_streaming_request_is_aborted(srv, http):
    before = metric(scrape(http), "portaserve:request_success_total", finished_reason="abort")
    # 16 choices x 120 tokens: far longer than the client waits (the tiny model decodes a
    # single sequence's 120 tokens in well under a second on the CPU)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + "/v1/completions", headers=AUTH, timeout=0.5,
                   json={"prompt": "long", "max_tokens": 120, "ignore_eos": True, "n": 16, "temperature": 1.0})
    assert wait_for(lambda: metric(scrape(http), "portaserve:request_success_total", finished_reason="abort") > before, 20)
    assert wait_for(lambda: srv.engine.latest_stats.num_running == 0, 20)


def test_metrics_count_tokens_and_latencies(client, http):
    text = scrape(http)
    gen_before = metric(text, "portaserve:generation_tokens_total")
    prompt_before = metric(text, "portaserve:prompt_tokens_total")
    ttft_before = metric(text, "portaserve:time_to_first_token_seconds_count")
    length_before = metric(text, "portaserve:request_success_total", finished_reason="length")
    r = client.completions.create(model="tiny", prompt="metrics please", max_tokens=7, temperature=0)
    text = scrape(http)
    assert metric(text, "portaserve:generation_tokens_total") - gen_before == 7
    assert metric(text, "portaserve:prompt_tokens_total") - prompt_before == r.usage.prompt_tokens
    assert metric(text, "portaserve:time_to_first_token_seconds_count") - ttft_before == 1
    assert metric(text, "portaserve:request_success_total", finished_reason="length") - length_before == 1
    for name in ("inter_token_latency_seconds_count", "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert metric(text, "portaserve:" + name) > 0, name
    assert metric(text, "portaserve:platform_info", platform="cpu", attention_backend="cpu_paged") == 1
    for name in ("num_requests_waiting", "num_preemptions_total", "prefix_cache_queries_total"):
        assert f"portaserve:{name}" in text


def test_prefix_cache_hits_in_metrics(client, http):
    hits_before = metric(scrape(http), "portaserve:prefix_cache_hits_total")
    prompt = list(range(1000, 1040))  # 40 tokens: two full blocks of 16
    for _ in range(2):
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert metric(scrape(http), "portaserve:prefix_cache_hits_total") - hits_before >= 32


# ----- chat rendering details ----------------------------------------------------------------------


def test_content_parts_and_continue_final_message(client, http):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, temperature=0)
    parts = client.chat.completions.create(
        model="tiny", max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}])
    joined = tokenize_chat(http, [{"role": "user", "content": "Hello\nthere"}])["count"]
    assert parts.usage.prompt_tokens == joined and plain.usage.prompt_tokens == tokenize_chat(http)["count"]
    convo = MESSAGES + [{"role": "assistant", "content": "The answer starts"}]
    tok = http.post("/tokenize", json={"messages": convo, "add_generation_prompt": False,
                                       "continue_final_message": True}).json()
    text = http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text.endswith("The answer starts")
    r = http.post("/v1/chat/completions", json={"messages": convo, "add_generation_prompt": False,
                                                 "continue_final_message": True, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == tok["count"]
    err = error_of(http.post("/v1/chat/completions", json={"messages": convo, "continue_final_message": True}), 400)
    assert err["param"] == "continue_final_message"
    err = error_of(http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), 400)
    assert err["param"] == "messages" and "messages[0].content[0]: this model does not take images" in err["message"]


def test_model_without_chat_template_is_400(srv, http, monkeypatch):
    monkeypatch.setattr(srv.engine.tokenizer, "chat_template", None)
    err = error_of(http.post("/v1/chat/completions", json={"messages": MESSAGES}), 400)
    assert err["param"] == "chat_template" and "--chat-template" in err["message"]


def test_tracing_spans(client, http):
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    if trace.get_tracer_provider() is not provider:
        pytest.skip("another tracer provider is already installed in this process")
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3},
                  headers={"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    assert r.status_code == 200
    spans = [s for s in exporter.get_finished_spans() if s.name == "chat.completions"]
    assert spans, exporter.get_finished_spans()
    span = spans[-1]
    assert format(span.context.trace_id, "032x") == trace_id
    assert span.attributes["gen_ai.request.model"] == "tiny"
    assert span.attributes["gen_ai.usage.completion_tokens"] == 3
    assert span.attributes["gen_ai.usage.prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    # a streamed response's span ends with the stream, counting what it sent
    list(client.completions.create(model="tiny", prompt="trace me", max_tokens=4, stream=True))
    assert wait_for(lambda: [s for s in exporter.get_finished_spans() if s.name == "completions"], 5)


def test_vllm_sampling_extras_reach_the_sampler(client):
    greedy = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0).choices[0].text
    top1 = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=1.0, seed=7,
                                     extra_body={"top_k": 1}).choices[0].text
    assert top1 == greedy
    sampled = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=1.0, seed=7).choices[0].text
    assert sampled != greedy
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=6, temperature=0,
                                  extra_body={"min_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.3, "min_p": 0.0})
    assert r.usage.completion_tokens == 6


ADMIN_ROUTES = [("POST", "/v1/update_weights", {"path": "/etc"}),
                ("POST", "/v1/init_weight_update_group", {"master_address": "10.0.0.1", "master_port": 1, "world_size": 2}),
                ("POST", "/v1/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}),
                ("POST", "/v1/destroy_weight_update_group", None), ("GET", "/v1/weights_info", None),
                ("POST", "/sleep", None), ("POST", "/wake_up", None), ("GET", "/is_sleeping", None)]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES, ids=[r[1] for r in ADMIN_ROUTES])
def test_admin_routes_are_404_without_enable_admin_api(http, method, path, body):
    r = http.request(method, path, json=body)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == 404


def test_a_pickle_pushed_into_the_engine_ipc_runs_nothing(srv, client, tmp_path):
    """The front end's inbox from the engine core (the IPC socket it binds; the core's own
    inbox is a connection the core makes to a PUSH socket, which takes no pushes) takes typed
    messages only: a pickled payload, what a local process able to reach the socket would
    send, is dropped as malformed, runs nothing and leaves the server serving."""
    import os
    import pickle
    import stat

    import zmq

    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDTIMEO, 10_000)  # a send that cannot be delivered fails, never hangs
    push.connect(srv.engine._out_addr)
    push.send(pickle.dumps(("add", Exploit())))
    push.close(linger=5000)
    ctx.term()
    assert stat.S_IMODE(os.stat(os.path.dirname(srv.engine._out_addr.removeprefix("ipc://"))).st_mode) == 0o700
    r = client.completions.create(model="tiny", prompt="still here", max_tokens=2)
    assert r.choices[0].text is not None
    assert not marker.exists()


def test_a_wrong_method_is_a_405_in_openai_shape(http):
    r = http.request("PUT", "/v1/chat/completions", json={})
    assert r.status_code == 405
    assert r.json()["error"]["code"] == 405 and r.json()["error"]["message"]
