"""The official `openai` Python client against a running handoff cluster.

Run by tests/openai_client.rs: `python3 tests/openai_client.py SPEC.json`, where
the spec names the base URL, the served model and what the colocated reference
says each request must produce (token ids; text as Rust's lossy UTF-8 decoding).
Exits non-zero at the first mismatch, naming it.
"""

import json
import sys
import urllib.error
import urllib.request

import openai


def check(cond, what):
    if not cond:
        print(f"FAILED: {what}", file=sys.stderr)
        sys.exit(1)
    print(f"ok: {what.splitlines()[0][:100]}")


def token_ids(choice):
    extra = getattr(choice, "model_extra", None) or {}
    return extra.get("token_ids", getattr(choice, "token_ids", None))


def raw(url, method="GET", body=None, content_type="application/json"):
    req = urllib.request.Request(url, data=body, method=method)
    if content_type is not None:
        req.add_header("Content-Type", content_type)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def error_shape(body):
    err = body.get("error", {})
    return all(k in err for k in ("message", "type", "param", "code"))


def main():
    spec = json.load(open(sys.argv[1]))
    base, model = spec["base_url"], spec["model"]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=60)

    # Models.
    ids = [m.id for m in client.models.list().data]
    check(ids == [model], f"models.list lists the served model: {ids}")
    check(client.models.retrieve(model).id == model, "models.retrieve(model)")

    # Completions, greedy by default.
    g = spec["greedy"]
    r = client.completions.create(model=model, prompt=g["prompt"], max_tokens=g["max_tokens"])
    c = r.choices[0]
    check(token_ids(c) == g["tokens"], f"greedy completion equals the colocated run: {token_ids(c)} vs {g['tokens']}")
    check(c.text == g["text"], "greedy completion text")
    check(c.finish_reason == "length", f"finish_reason length: {c.finish_reason}")
    check(r.usage.prompt_tokens == len(g["prompt"].encode()) and r.usage.completion_tokens == g["max_tokens"], f"usage {r.usage}")
    check(r.model == model and r.object == "text_completion", "completion object and model")

    # The same, streamed.
    text, finish, streamed = "", None, []
    for chunk in client.completions.create(model=model, prompt=g["prompt"], max_tokens=g["max_tokens"], stream=True):
        for ch in chunk.choices:
            text += ch.text
            streamed += token_ids(ch) or []
            finish = ch.finish_reason or finish
    check(streamed == g["tokens"] and text == g["text"] and finish == "length", f"streamed completion: {streamed}, {finish}")

    # Stop strings.
    s = spec["stop"]
    r = client.completions.create(model=model, prompt=s["prompt"], max_tokens=s["max_tokens"], stop=[s["stop"]])
    c = r.choices[0]
    check(c.finish_reason == "stop" and c.text == s["text"], f"stop {s['stop']!r}: {c.finish_reason} {c.text!r} vs {s['text']!r}")
    text = ""
    for chunk in client.completions.create(model=model, prompt=s["prompt"], max_tokens=s["max_tokens"], stop=s["stop"], stream=True):
        for ch in chunk.choices:
            text += ch.text
            finish = ch.finish_reason or finish
    check(text == s["text"] and finish == "stop", f"streamed stop: {text!r}")

    # Seeded sampling, n choices: each equals the colocated run of its choice index.
    n = spec["sampled"]
    r = client.completions.create(model=model, prompt=n["prompt"], max_tokens=n["max_tokens"], n=len(n["choices"]),
                                  temperature=n["temperature"], top_p=n["top_p"], seed=n["seed"])
    got = sorted(r.choices, key=lambda c: c.index)
    check([c.index for c in got] == list(range(len(n["choices"]))), "n choices, indexed")
    for c, want in zip(got, n["choices"]):
        check(token_ids(c) == want, f"seeded choice {c.index} equals the colocated sampled run: {token_ids(c)} vs {want}")
    check(len({tuple(token_ids(c)) for c in got}) > 1, "choices of one seed differ from each other")
    check(r.usage.completion_tokens == n["max_tokens"] * len(n["choices"]), f"usage over n choices: {r.usage}")
    again = client.completions.create(model=model, prompt=n["prompt"], max_tokens=n["max_tokens"], n=len(n["choices"]),
                                      temperature=n["temperature"], top_p=n["top_p"], seed=n["seed"])
    check([token_ids(c) for c in sorted(again.choices, key=lambda c: c.index)] == n["choices"], "the same seed gives the same tokens")

    # Chat, with the byte-level template.
    ch = spec["chat"]
    r = client.chat.completions.create(model=model, messages=ch["messages"], max_tokens=ch["max_tokens"])
    m = r.choices[0]
    check(m.message.role == "assistant" and m.message.content == ch["text"], f"chat reply equals the colocated run of the template: {m.message.content!r} vs {ch['text']!r}")
    check(m.finish_reason == "length" and r.usage.prompt_tokens == ch["prompt_tokens"], f"chat usage {r.usage}")
    check(r.object == "chat.completion", "chat object")
    text, usage, roles = "", None, []
    for chunk in client.chat.completions.create(model=model, messages=ch["messages"], max_tokens=ch["max_tokens"], stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.delta.role:
                roles.append(c.delta.role)
    check(text == ch["text"] and roles == ["assistant"], f"streamed chat: {text!r}")
    check(usage is not None and usage.completion_tokens == ch["max_tokens"], f"streamed chat usage: {usage}")
    sc = spec["chat_sampled"]
    r = client.chat.completions.create(model=model, messages=ch["messages"], max_tokens=ch["max_tokens"], temperature=sc["temperature"], seed=sc["seed"])
    check(r.choices[0].message.content == sc["text"], "seeded chat equals the colocated sampled run")

    # Errors: typed by the client from the status, every body in OpenAI's shape.
    try:
        client.completions.create(model="not-" + model, prompt="x", max_tokens=2)
        check(False, "another model must be refused")
    except openai.NotFoundError as e:
        check(e.status_code == 404 and e.code == "model_not_found" and e.param == "model", f"another model: 404 model_not_found ({e.body})")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=0)
        check(False, "max_tokens 0 must be refused")
    except openai.BadRequestError as e:
        check(e.status_code == 400 and e.type == "invalid_request_error", f"max_tokens 0: 400 ({e.body})")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"prompt_token_ids": [1, 2]})
        check(False, "prompt with prompt_token_ids must be refused")
    except openai.BadRequestError as e:
        check(e.param == "prompt" and "not both" in e.message, f"prompt + prompt_token_ids: 400 ({e.body})")
    try:
        client.completions.create(model=model, prompt="x", max_tokens=2, logprobs=2)
        check(False, "logprobs must be refused, not ignored")
    except openai.BadRequestError as e:
        check(e.code == "unsupported_parameter" and e.param == "logprobs", f"logprobs: 400 ({e.body})")

    root = base.rsplit("/v1", 1)[0]
    status, body = raw(base + "/completions", "POST", b'{"prompt": "x"}', content_type="text/plain")
    check(status == 415 and error_shape(body), f"text/plain: 415 {body}")
    status, body = raw(base + "/completions", "GET")
    check(status == 405 and error_shape(body), f"GET on a POST route: 405 {body}")
    status, body = raw(root + "/no/such/route")
    check(status == 404 and error_shape(body), f"unknown route: 404 {body}")
    status, body = raw(base + "/completions", "POST", b'{"prompt": "' + b"a" * (spec["body_limit"] + 10) + b'"}')
    check(status == 413 and error_shape(body), f"oversized body: 413 {body['error']['code']}")
    status, body = raw(base + "/completions", "POST", b'{"prompt": ')
    check(status == 400 and error_shape(body), f"malformed JSON: 400 {body}")
    print("openai client: every check passed")


if __name__ == "__main__":
    main()
