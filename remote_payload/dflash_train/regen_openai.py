"""The `openai` engine of `dflash_train.regen`: any OpenAI-compatible server reachable from the
container (vLLM, SGLang), with `--concurrency` requests at once. Standard library only (urllib
and threads): a container may lack every HTTP package.

Chat rows go to POST <endpoint>/v1/chat/completions (the server applies the chat template;
`--thinking` is sent as `chat_template_kwargs.enable_thinking`, which vLLM and SGLang pass to
the template), prompt and token rows to POST <endpoint>/v1/completions (token ids as the
prompt). Each request carries `seed` = --seed + the row's index. A 429, a 5xx, a connection
error or an answer that is not JSON (a torn body, a proxy's page) is retried up to --retries
times, after Retry-After when the server sends one, else after 0.25 s doubling up to 30 s; any
other 4xx, and a JSON answer without choices, is that row's error. A server that stays down
ends the run (exit 1, resumable).

A token row holds the tokens of the text the server returned, and nothing more: the token it
stopped at is not in that text, and which one it was (an end-of-text, an end-of-turn, a stop
string) the answer does not say."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

from .regen_rows import (
    Done,
    EngineError,
    Options,
    Row,
    RowError,
    SharedTokenizer,
    chat_row,
    conversation,
    row_kind,
    token_ids,
    token_row,
)

REQUEST_TIMEOUT_S = 600.0  # one generation may take minutes on a loaded server
BASE_DELAY_S, MAX_DELAY_S, RETRY_AFTER_CAP_S = 0.25, 30.0, 60.0


class Abandoned(Exception):
    """A stop came while a request waited to be retried: the batch is redone on resume."""


def base_url(endpoint: str) -> str:
    """`http://host:8000`, `.../` or `.../v1` as the API root ending in /v1."""
    url = endpoint.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def with_thinking(content: str, reasoning: str | None) -> str:
    """The reply as the target wrote it: a server with a reasoning parser returns the think block
    apart; it goes back in front the way Qwen3's template renders a last assistant turn."""
    if not reasoning:
        return content
    return f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"


class OpenAIEngine:
    """Regeneration through an OpenAI-compatible endpoint; see the module docstring."""

    def __init__(
        self, endpoint: str, model: str, concurrency: int, retries: int, options: Options, tokenizer_dir: str | None
    ):
        self.url, self.model, self.retries, self.options = base_url(endpoint), model, retries, options
        self.workers = concurrency
        self.batch_reason = ""
        self.requests = 0  # requests sent and not yet answered (`waiting`)
        self.lock = threading.Lock()
        self.tokenizer = SharedTokenizer(
            tokenizer_dir, "prompt and token rows need --tokenizer DIR with the openai engine"
        )

    def setup(self, worker: int) -> None:
        """Nothing to build: the server holds the model."""

    def peak_memory_gb(self) -> float | None:
        """None: the server's memory is not ours to read."""
        return None

    def waiting(self) -> str | None:
        """The requests the server has not answered yet, and how long each may take."""
        n = self.requests
        return (
            f"{n} request{'' if n == 1 else 's'} waiting on {self.url} (each gives up after {REQUEST_TIMEOUT_S:g} s, "
            f"then retries {self.retries} times)"
        )

    def run(self, worker: int, batch: int, rows: list[Row]) -> list[Done] | None:
        """The batch's rows one after another (the workers run batches side by side)."""
        results = []
        for row in rows:
            if self.options.stop.is_set():
                return None
            try:
                results.append(self.one(row))
            except RowError as exc:
                results.append(Done(row.index, error=str(exc)))
            except Abandoned:
                return None
        return results

    def one(self, row: Row) -> Done:
        """One row's request and its output row."""
        if row.error is not None:
            raise RowError(row.error)
        o = self.options
        body = {
            "model": self.model,
            "max_tokens": o.max_new_tokens,
            "temperature": o.temperature,
            "top_p": o.top_p,
            "seed": o.seed + row.index,
        }
        kind = row_kind(row.data)
        if kind == "messages":
            convo = conversation(row.data["messages"])
            if o.thinking is not None:
                body["chat_template_kwargs"] = {"enable_thinking": o.thinking}
            choice, used = self.post("chat/completions", {**body, "messages": convo})
            message = choice.get("message") or {}
            if not isinstance(message.get("content"), str):
                raise RowError(f"the server's reply has no message content: {json.dumps(choice)[:200]}")
            thought = message.get("reasoning_content") or message.get("reasoning")
            if thought is not None and not isinstance(thought, str):
                raise RowError(f"the server's reasoning_content is not text: {json.dumps(thought)[:200]}")
            reply = with_thinking(message["content"], thought)
            finish = finish_reason(choice, used, o.max_new_tokens)
            return Done(row.index, chat_row(row.index, convo, reply, finish), new_tokens=used)
        if kind == "prompt":
            prompt = row.data["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise RowError("prompt must be a non-empty string")
        else:
            prompt = token_ids(row.data["input_ids"])
        choice, used = self.post("completions", {**body, "prompt": prompt})
        if not isinstance(choice.get("text"), str):
            raise RowError(f"the server's reply has no text: {json.dumps(choice)[:200]}")
        finish = finish_reason(choice, used, o.max_new_tokens)
        with self.tokenizer as tok:
            ids = prompt if kind == "input_ids" else list(tok(prompt)["input_ids"])
            new = list(tok(choice["text"], add_special_tokens=False)["input_ids"])
        return Done(row.index, token_row(row.index, ids, new, finish), new_tokens=len(new))

    @contextlib.contextmanager
    def asking(self) -> Iterator[None]:
        """Count a request as waiting on the server while it is inside."""
        with self.lock:
            self.requests += 1
        try:
            yield
        finally:
            with self.lock:
                self.requests -= 1

    def post(self, path: str, body: dict) -> tuple[dict, int]:
        """POST body to <url>/<path>: (the answer's first choice, completion tokens it counts).
        Retries as the module docstring says."""
        data = json.dumps(body).encode()
        attempt = 0
        while True:
            request = urllib.request.Request(
                f"{self.url}/{path}", data=data, method="POST", headers={"Content-Type": "application/json"}
            )
            try:
                with self.asking(), urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as answer:
                    reply = json.loads(answer.read())
            except urllib.error.HTTPError as exc:
                detail = exc.read()[:300].decode("utf-8", "replace")
                if exc.code != 429 and exc.code < 500:
                    raise RowError(f"HTTP {exc.code} from {path}: {detail}") from None
                why, wait = f"HTTP {exc.code}", retry_after(exc.headers.get("Retry-After"))
            except (
                urllib.error.URLError,
                ConnectionError,
                socket.timeout,
                TimeoutError,
                http.client.HTTPException,
            ) as exc:  # HTTPException: a body cut short (IncompleteRead)
                why, wait = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}", None
            except ValueError as exc:  # a 200 whose body is not JSON: torn, or not the server's
                why, wait = f"an answer that is not JSON ({exc})", None
            else:
                return first_choice(reply, path)
            if attempt == self.retries:
                raise EngineError(
                    f"{self.url}/{path}: {why} after {attempt + 1} attempts (is the server up? --resume continues)"
                )
            delay = wait if wait is not None else min(MAX_DELAY_S, BASE_DELAY_S * 2**attempt)
            if self.options.stop.wait(delay):
                raise Abandoned()
            attempt += 1


def first_choice(reply: object, path: str) -> tuple[dict, int]:
    """(the answer's first choice, the completion tokens its usage counts, 0 when absent);
    RowError for an answer without choices."""
    choices = reply.get("choices") if isinstance(reply, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise RowError(f"the server's answer from {path} has no choices: {json.dumps(reply)[:200]}")
    usage = reply.get("usage")
    used = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return choices[0], used if isinstance(used, int) and not isinstance(used, bool) else 0


def finish_reason(choice: dict, used: int, max_tokens: int) -> str:
    """The choice's finish_reason as the server gives it. The API sets one on every finished
    choice (null only in a stream's unfinished chunks); for a server that leaves it null: `length`
    when its usage counts max_tokens generated (the API's meaning of `length`: the limit was
    reached), else `unknown` (not `stop`: nothing says the target ended its turn)."""
    reason = choice.get("finish_reason")
    if isinstance(reason, str) and reason:
        return reason
    return "length" if used >= max_tokens else "unknown"


def retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (capped), or None when absent or an HTTP date."""
    try:
        return min(RETRY_AFTER_CAP_S, max(0.0, float(value))) if value is not None else None
    except ValueError:
        return None
