"""Test stand-in for an OpenAI-compatible server (vLLM, SGLang): NOT a model server.

It honours the request and response shapes that `dflash_train.regen --engine openai` relies on:
  POST /v1/chat/completions  {model, messages, max_tokens, temperature, top_p, seed,
                              chat_template_kwargs?} -> {id, object, model, choices: [{index,
                              message: {role, content, reasoning_content?}, finish_reason}], usage}
  POST /v1/completions       {model, prompt (text or token ids), ...} -> {..., choices: [{index,
                              text, finish_reason}], usage}
  GET  /v1/models            {object: list, data: [{id, object}]}
An unknown model is a 404 and a body without messages/prompt a 400, with vLLM's error shape
({"error": {"message", "type", "code"}}). The "generation" is a deterministic function of the
request: words `w<k>` derived from the prompt and the seed, max_tokens of them at most
(finish_reason `length`), else 3 + seed % 4 of them (`stop`). With chat_template_kwargs
enable_thinking true it answers as a server with a reasoning parser does: the think text in
`reasoning_content`, the answer in `content`. A prompt containing FAIL-ROW is a 400 (a row the
server refuses), NO-CHOICES a 200 whose JSON has no `choices`, NULL-FINISH an answer whose
finish_reason is null, ODD-REASONING a chat answer whose `reasoning_content` is an object, HOLD
no answer at all (the connection stays open) until the file --hold-until names exists (never,
without it): a server that accepts and never answers.

    python openai_standin.py --port-file F [--model NAME] [--fail K] [--fail-status 500,429] [--log F]
                             [--hold-until FILE]

--fail K answers the first K generation requests with the statuses of --fail-status in turn
(429 with `Retry-After: 0`; 200: a JSON body cut short), to exercise the client's retries; --log
appends every request body as a JSON line. It listens on 127.0.0.1 on a free port, written to --port-file once bound.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def words(seed_text: str, count: int) -> list[str]:
    """`count` deterministic words from a text."""
    digest = hashlib.sha256(seed_text.encode()).digest()
    return [f"w{digest[i % len(digest)] % 50}" for i in range(count)]


class Standin:
    """The server's state: the model it serves, failures still to give, the request log."""

    def __init__(self, model: str, fail: int, statuses: list[int], log: str | None, hold_until: str | None = None):
        self.model, self.fail, self.statuses, self.log = model, fail, statuses, log
        self.hold_until = hold_until
        self.served = 0
        self.lock = threading.Lock()

    def next_failure(self) -> int | None:
        """The status to fail this request with, or None to serve it."""
        with self.lock:
            if self.served < self.fail:
                status = self.statuses[self.served % len(self.statuses)]
                self.served += 1
                return status
            self.served += 1
            return None

    def hold(self) -> None:
        """Answer nothing until the --hold-until file exists (forever without one)."""
        while not (self.hold_until and os.path.exists(self.hold_until)):
            time.sleep(0.05)

    def record(self, path: str, body: dict) -> None:
        """Append the request to the log."""
        if self.log:
            with self.lock, open(self.log, "a") as fh:
                fh.write(json.dumps({"path": path, "body": body}) + "\n")


def generate(body: dict, text: str) -> tuple[list[str], str]:
    """(the reply's words, finish_reason) for a request whose prompt is `text`."""
    seed = int(body.get("seed") or 0)
    want = 3 + seed % 4
    limit = int(body.get("max_tokens") or 16)
    out = words(f"{text}|{seed}|{body.get('temperature')}", min(want, limit))
    return out, "stop" if want <= limit else "length"


def make_handler(state: Standin) -> type:
    """The request handler class bound to the server's state."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:  # keep the test output clean
            pass

        def reply(self, status: int, obj: dict, headers: dict | None = None) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(data)

        def error(self, status: int, message: str, kind: str = "BadRequestError") -> None:
            self.reply(
                status,
                {"error": {"message": message, "type": kind, "code": status}},
                {"Retry-After": "0"} if status == 429 else None,
            )

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.rstrip("/") == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": state.model, "object": "model"}]})
            else:
                self.error(404, f"no route {self.path}", "NotFoundError")

        def do_POST(self) -> None:  # noqa: N802
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            except ValueError:
                self.error(400, "body is not JSON")
                return
            route = self.path.rstrip("/")
            if route not in ("/v1/chat/completions", "/v1/completions"):
                self.error(404, f"no route {self.path}", "NotFoundError")
                return
            state.record(route, body)
            status = state.next_failure()
            if status == 200:  # a torn answer: the body ends mid-JSON
                torn = b'{"id": "cmpl-standin", "choices": [{"index": 0, "te'
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(torn)))
                self.end_headers()
                self.wfile.write(torn)
                return
            if status is not None:
                self.error(
                    status, "stand-in: injected failure", "RateLimitError" if status == 429 else "InternalServerError"
                )
                return
            if body.get("model") != state.model:
                self.error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
                return
            chat = route == "/v1/chat/completions"
            given = body.get("messages" if chat else "prompt")
            if chat and (not isinstance(given, list) or not given):
                self.error(400, "messages must be a non-empty list")
            elif not chat and not given:
                self.error(400, "prompt must be given")
            elif "HOLD" in json.dumps(given):
                state.hold()
                (self.chat if chat else self.completion)(body, json.dumps(given))
            elif "FAIL-ROW" in json.dumps(given):
                self.error(400, "stand-in: this prompt is refused")
            elif "NO-CHOICES" in json.dumps(given):
                self.reply(200, {"id": "standin", "object": "error", "message": "stand-in: no choices"})
            else:
                (self.chat if chat else self.completion)(body, json.dumps(given))

        def chat(self, body: dict, text: str) -> None:
            out, finish = generate(body, text)
            finish = None if "NULL-FINISH" in text else finish
            message = {"role": "assistant", "content": " ".join(out)}
            if (body.get("chat_template_kwargs") or {}).get("enable_thinking"):
                message["reasoning_content"] = "thinking " + " ".join(words(text, 2))
            if "ODD-REASONING" in text:
                message["reasoning_content"] = {"steps": words(text, 2)}
            self.reply(
                200,
                {
                    "id": "chatcmpl-standin",
                    "object": "chat.completion",
                    "model": state.model,
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": {
                        "prompt_tokens": len(text.split()),
                        "completion_tokens": len(out),
                        "total_tokens": len(text.split()) + len(out),
                    },
                },
            )

        def completion(self, body: dict, text: str) -> None:
            out, finish = generate(body, text)
            finish = None if "NULL-FINISH" in text else finish
            self.reply(
                200,
                {
                    "id": "cmpl-standin",
                    "object": "text_completion",
                    "model": state.model,
                    "choices": [{"index": 0, "text": " " + " ".join(out), "finish_reason": finish}],
                    "usage": {"prompt_tokens": 0, "completion_tokens": len(out), "total_tokens": len(out)},
                },
            )

    return Handler


def main() -> None:
    """Serve until killed."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port-file", required=True)
    ap.add_argument("--model", default="standin")
    ap.add_argument("--fail", type=int, default=0)
    ap.add_argument("--fail-status", default="500,429")
    ap.add_argument("--log")
    ap.add_argument("--hold-until")
    args = ap.parse_args()
    state = Standin(args.model, args.fail, [int(s) for s in args.fail_status.split(",")], args.log, args.hold_until)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    with open(args.port_file + ".tmp", "w") as fh:
        fh.write(str(server.server_address[1]))
    os.replace(args.port_file + ".tmp", args.port_file)
    server.serve_forever()


if __name__ == "__main__":
    main()
