#!/usr/bin/env python3
"""Calls a pdnode router with the official `openai` client (pip install openai).

    python3 examples/openai_client.py --base-url http://127.0.0.1:8000/v1
    python3 examples/openai_client.py --base-url http://127.0.0.1:8000/v1 --api-key sk-... --check

Runs chat and completions, streaming and not. With --check it also asserts the answers are
well-formed (non-empty text, usage numbers, a 400 for n=2) and exits non-zero otherwise; the
router's integration test `openai_python_client` runs it that way against fake nodes.
"""

import argparse
import sys

import openai
from openai import OpenAI


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="default: the first of /v1/models")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key, timeout=30, max_retries=0)
    model = args.model or client.models.list().data[0].id
    print(f"model: {model}")
    failures = []

    def check(cond: bool, what: str) -> None:
        if args.check and not cond:
            failures.append(what)

    # Completions, whole.
    c = client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=args.max_tokens, temperature=0
    )
    print(f"completion: {c.choices[0].text!r} finish={c.choices[0].finish_reason} usage={c.usage}")
    check(len(c.choices[0].text) > 0, "completion text is empty")
    check(c.usage is not None and c.usage.completion_tokens > 0, "completion usage missing")

    # Completions, streamed, with usage.
    parts, usage = [], None
    for chunk in client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=args.max_tokens,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    print(f"completion stream: {''.join(parts)!r} usage={usage}")
    check(len("".join(parts)) > 0, "streamed completion is empty")
    check(usage is not None and usage.completion_tokens > 0, "streamed usage missing")

    # Chat, whole.
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 2 + 2?"},
    ]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=args.max_tokens, seed=1)
    print(f"chat: {r.choices[0].message.content!r} finish={r.choices[0].finish_reason} usage={r.usage}")
    check(bool(r.choices[0].message.content), "chat content is empty")
    check(r.choices[0].message.role == "assistant", "chat role is not assistant")

    # Chat, streamed.
    parts = []
    for chunk in client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=args.max_tokens, stream=True
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    print(f"chat stream: {''.join(parts)!r}")
    check(len("".join(parts)) > 0, "streamed chat is empty")

    # An invalid request is a clean 400.
    try:
        client.completions.create(model=model, prompt="x", n=2)
        check(False, "n=2 was accepted")
    except openai.BadRequestError as e:
        print(f"n=2 refused as expected: {e.status_code}")

    if failures:
        print("FAILED: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
