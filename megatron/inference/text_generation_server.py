"""`MegatronServer`: Megatron's REST text-generation server on the standard library's `ThreadingHTTPServer`.

Routes:
- `PUT /api`: Megatron's request/response schema (`{"prompts": [...], "tokens_to_generate": n, ...}` ->
  `{"text", "tokens", "segments", "logprobs"?}`), checked as Megatron checks it (`endpoints/common.py`);
- `POST /v1/completions` (and `/completions`) and `POST /v1/chat/completions`: OpenAI-compatible, with
  `"stream": true` answered as server-sent events (`data: {chunk}` lines, then `data: [DONE]`), one chunk per
  generated token as the engine produces it;
- `GET /health`, `GET /v1/models`.

Requests are served on threads; generations are serialised with a lock (one engine), and on a multi-rank
run every generation is broadcast to the other ranks first (`ModelParallelSync`). Every bad request gets a
4xx with a JSON `{"error": {"message", "type"}}` body and the server keeps serving: malformed JSON, wrong
types or values, bodies over `max_request_bytes` (413), prompts that do not fit the engine's sequence
length. Megatron answers most `/api` validation failures with HTTP 200 and a string; here they are 400s.
The server binds 127.0.0.1 unless another host is given.
"""
import json
import logging
import threading
import traceback
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, Optional

from megatron.inference.endpoints.common import RequestError, check_prompt_lengths, parse_api_request
from megatron.inference.endpoints.completions import (
    chat_response,
    completion_response,
    cut_at_stop,
    parse_chat_request,
    parse_completion_request,
    stream_chunk,
)
from megatron.inference.text_generation.mcore_engine_server import ModelParallelSync

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20


class _Handler(BaseHTTPRequestHandler):
    server_version = "MegatronTextGeneration/1.0"

    def log_message(self, format, *args):  # noqa: A002 (BaseHTTPRequestHandler's signature)
        logger.info("%s %s", self.address_string(), format % args)

    # responses ---------------------------------------------------------------------------------------------
    def _send_json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str) -> None:
        kind = "invalid_request_error" if status < 500 else "server_error"
        self._send_json(status, {"error": {"message": message, "type": kind, "code": status}})

    # routing -----------------------------------------------------------------------------------------------
    def do_GET(self):  # noqa: N802 (http.server's naming)
        if self.path == "/health":
            return self._send_json(200, {"status": "ok"})
        if self.path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [{"id": self.server.model_name, "object": "model",
                                                                     "owned_by": "megatron"}]})
        return self._not_found()

    def do_PUT(self):  # noqa: N802
        if self.path == "/api":
            return self._guarded(self._api)
        return self._not_found()

    def do_POST(self):  # noqa: N802
        routes = {"/v1/completions": self._completions, "/completions": self._completions,
                  "/v1/chat/completions": self._chat}
        if self.path in routes:
            return self._guarded(routes[self.path])
        return self._not_found()

    def _not_found(self):
        known = {"/api": "PUT", "/v1/completions": "POST", "/completions": "POST", "/v1/chat/completions": "POST",
                 "/health": "GET", "/v1/models": "GET"}
        if self.path in known:
            self._read_body_or_skip()
            return self._send_error(405, f"{self.command} is not allowed on {self.path}: use {known[self.path]}")
        return self._send_error(404, f"no route {self.path}")

    def _read_body_or_skip(self) -> None:
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) <= self.server.max_request_bytes:
            self.rfile.read(int(length))

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("a Content-Length header is required", status=411)
        if not length.isdigit():
            raise RequestError("Content-Length must be a non-negative integer")
        if int(length) > self.server.max_request_bytes:
            self.close_connection = True
            raise RequestError(f"the request body ({length} bytes) exceeds {self.server.max_request_bytes} bytes",
                               status=413)
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RequestError(f"the request body is not valid JSON: {error}") from None

    def _guarded(self, route) -> None:
        try:
            route(self._read_json())
        except RequestError as error:
            self._send_error(error.status, error.message)
        except ValueError as error:  # raised by the engine for a request it cannot run
            self._send_error(400, str(error))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as error:  # noqa: BLE001 (the server must keep serving)
            logger.error("request failed:\n%s", traceback.format_exc())
            self._send_error(500, f"internal error: {type(error).__name__}: {error}")

    # generation --------------------------------------------------------------------------------------------
    def _tokenize(self, texts, add_bos=False):
        controller = self.server.engine.text_generation_controller
        try:
            return [controller.tokenize_prompt(t, add_bos) for t in texts]
        except Exception as error:  # noqa: BLE001 (tokenizers raise anything on text they cannot encode)
            raise RequestError(f"the prompt cannot be tokenized: {error}") from None

    def _generate(self, prompt_tokens, tokens_to_generate, streaming=None, **kwargs):
        check_prompt_lengths(prompt_tokens, tokens_to_generate, self.server.max_sequence_length)
        with self.server.lock:
            return self.server.sync.submit(prompts=None, prompt_tokens=prompt_tokens,
                                           tokens_to_generate=tokens_to_generate, streaming=streaming, **kwargs)

    def _api(self, body) -> None:
        args = parse_api_request(body)
        add_bos = bool(body.get("add_BOS", False))
        tokens = self._tokenize(args["prompts"], add_bos)
        results = self._generate(tokens, args["tokens_to_generate"], temperature=args["temperature"],
                                 top_k=args["top_k"], top_p=args["top_p"], logprobs=args["logprobs"],
                                 random_seed=args["random_seed"])
        response = {
            "text": [r.prompt + r.generated_text for r in results],
            "tokens": [list(r.prompt_tokens) + list(r.generated_tokens) for r in results],
            "segments": [r.segments for r in results],
        }
        if args["logprobs"]:
            response["logprobs"] = [list(r.prompt_log_probs) + list(r.generated_log_probs) for r in results]
        self._send_json(200, response)

    def _sampling_kwargs(self, parsed: Dict[str, Any]) -> Dict[str, Any]:
        return dict(temperature=parsed["temperature"], top_k=parsed["top_k"], top_p=parsed["top_p"],
                    logprobs=bool(parsed["logprobs"]) or parsed["max_tokens"] == 0,
                    top_n_logprobs=parsed["logprobs"], random_seed=parsed["random_seed"])

    def _completions(self, body) -> None:
        parsed = parse_completion_request(body, self.server.tokenizer)
        if parsed["stream"]:
            return self._stream(parsed, chat=False)
        results = self._generate(parsed["prompt_tokens"], parsed["max_tokens"], **self._sampling_kwargs(parsed))
        self._send_json(200, completion_response(parsed, results, self.server.tokenizer))

    def _chat(self, body) -> None:
        parsed = parse_chat_request(body, self.server.tokenizer)
        if parsed["stream"]:
            return self._stream(parsed, chat=True)
        results = self._generate(parsed["prompt_tokens"], parsed["max_tokens"], **self._sampling_kwargs(parsed))
        self._send_json(200, chat_response(parsed, results))

    def _stream(self, parsed: Dict[str, Any], chat: bool) -> None:
        """Server-sent events: a chunk per new piece of text, the final chunk with finish_reason, [DONE]."""
        check_prompt_lengths(parsed["prompt_tokens"], parsed["max_tokens"], self.server.max_sequence_length)
        stream = _TextStream(self, parsed, chat)
        try:
            results = self._generate(parsed["prompt_tokens"], parsed["max_tokens"], streaming=stream.on_tokens,
                                     **self._sampling_kwargs(parsed))
        except (RequestError, ValueError) as error:
            if not stream.started:
                raise
            stream.send({"error": {"message": str(error), "type": "invalid_request_error"}})
            return stream.done()
        stream.finish(results[0])


class _TextStream:
    """Turns the engine's per-step token lists into text deltas (holding back a possible stop string)."""

    def __init__(self, handler: _Handler, parsed: Dict[str, Any], chat: bool):
        self.handler, self.parsed, self.chat = handler, parsed, chat
        self.tokenizer = handler.server.tokenizer
        self.prompt_tokens = parsed["prompt_tokens"][0]
        self.prompt_text = self.tokenizer.detokenize(self.prompt_tokens)
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.sent, self.started, self.stopped, self.broken = 0, False, False, False
        self.hold = max((len(s) for s in parsed["stop"]), default=1) - 1

    def _text(self, generated) -> str:
        text = self.tokenizer.detokenize(list(self.prompt_tokens) + list(generated))
        return text[len(self.prompt_text):] if text.startswith(self.prompt_text) else self.tokenizer.detokenize(generated)

    def send(self, payload) -> None:
        if self.broken:
            return
        try:
            if not self.started:
                self.handler.send_response(200)
                self.handler.send_header("Content-Type", "text/event-stream")
                self.handler.send_header("Cache-Control", "no-cache")
                self.handler.send_header("Connection", "close")
                self.handler.end_headers()
                self.started = True
            data = payload if isinstance(payload, str) else json.dumps(payload)
            self.handler.wfile.write(f"data: {data}\n\n".encode("utf-8"))
            self.handler.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client left: generation finishes quietly
            self.broken = True

    def _emit(self, text: str, final: bool) -> None:
        if self.stopped:
            return
        text, found = cut_at_stop(text, self.parsed["stop"])
        self.stopped = found
        end = len(text) if (found or final) else max(self.sent, len(text) - self.hold)
        if end > self.sent or not self.started:
            first = not self.started
            self.send(stream_chunk(self.chat, self.id, self.parsed["model"], text[self.sent:end], first=first))
            self.sent = end

    def on_tokens(self, index: int, generated) -> None:
        """Engine callback after every step."""
        self._emit(self._text(generated), final=False)

    def finish(self, request) -> None:
        self._emit(request.generated_text, final=True)
        reason = "stop" if self.stopped or request.generated_length < self.parsed["max_tokens"] else "length"
        self.send(stream_chunk(self.chat, self.id, self.parsed["model"], None, reason))
        self.done()

    def done(self) -> None:
        self.send("[DONE]")
        self.handler.close_connection = True


class _HTTPServer(ThreadingHTTPServer):
    """Threaded server with a listen backlog for bursts of clients (the default of 5 resets connections)."""

    request_queue_size = 256
    daemon_threads = True


class MegatronServer:
    """The REST server over a `StaticInferenceEngine` (Megatron's `MegatronServer(engine, args)`)."""

    def __init__(self, engine, args=None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 model_name: str = "megatron"):
        self.engine = engine
        self.args = args
        self.max_request_bytes = max_request_bytes
        self.model_name = model_name
        self.httpd: Optional[ThreadingHTTPServer] = None

    def _build(self, host: str, port: int) -> ThreadingHTTPServer:
        httpd = _HTTPServer((host, port), _Handler)
        controller = self.engine.text_generation_controller
        httpd.engine = self.engine
        httpd.tokenizer = controller.tokenizer
        httpd.max_sequence_length = controller.inference_wrapped_model.inference_wrapper_config.inference_max_seq_length
        httpd.max_request_bytes = self.max_request_bytes
        httpd.model_name = self.model_name
        httpd.lock = threading.Lock()
        httpd.sync = ModelParallelSync(self.engine)
        return httpd

    def start(self, host: str = "127.0.0.1", port: int = 5000) -> int:
        """Serve on a background thread; returns the bound port (pass 0 for a free one)."""
        self.httpd = self._build(host, port)
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="megatron-server").start()
        return self.httpd.server_address[1]

    def run(self, url: str = "127.0.0.1", port: int = 5000) -> None:
        """Serve until interrupted, then release the other ranks."""
        self.httpd = self._build(url, port)
        try:
            self.httpd.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop serving and release the other ranks."""
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.httpd.sync.stop()
            self.httpd = None


__all__ = ["MegatronServer", "DEFAULT_MAX_REQUEST_BYTES"]
