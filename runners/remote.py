"""The remote engine: an OpenAI-compatible server (llama-server, vLLM, SGLang, Ollama's /v1).

Everything is measured on the client from the stream: the time to the first content chunk and
every gap after it. Token counts come from the server's `usage` when it sends one; where the
server reports its own timings (llama.cpp's `timings`: prompt_n, prompt_ms, predicted_n,
predicted_ms, cache_n) they are kept beside the client's figures, so the difference — network
and queueing — becomes visible.

A stream that breaks off (server killed, malformed line, read timeout) ends the request with the
text received so far and the stats marked `incomplete`, with the reason in `extra["error"]`.
"""

from __future__ import annotations

import base64
import codecs
import dataclasses
import itertools
import json
import math
import os
import re
import ssl
import stat
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import httpx2 as httpx

from .base import (
    DEFAULT_TIMEOUT_S,
    Event,
    Finished,
    LoadStarted,
    ModelLoaded,
    Request,
    SamplingParams,
    Token,
)
from .errors import (
    BadEndpointError,
    EnvironmentSettingError,
    NoServerModelError,
    OptionError,
    ProxyUnreachableError,
    ServerError,
    ServerTimeoutError,
    ServerUnreachableError,
    cut,
    json_kind,
)
from .reasoning import TokenTagger
from .serving import figures
from .stats import (
    FINISH_INCOMPLETE,
    FINISH_INTERRUPTED,
    FINISH_LENGTH,
    FINISH_STOP,
    GenerationStats,
    PausedClock,
    ServerReport,
    ServerSettings,
    ServerTimings,
)

# `llmrun serve`'s timings (runners/serving/api_engine.RequestTimings) under llama-server's names.
LLMRUN_TIMINGS = {
    "prefill_tokens": "prompt_n",
    "prefill_ms": "prompt_ms",
    "output_tokens": "predicted_n",
    "decode_ms": "predicted_ms",
    "reused_tokens": "cache_n",
}

# A model id longer than this is not taken from /v1/models: it is shown in every summary and
# stored in every record (Hugging Face's org/name is at most 96 characters; Ollama's are short).
MAX_MODEL_ID = 256
# A server's words shown in a message (its errors, a redirect's target) are cut past this.
MAX_SERVER_WORDS = 300


def server_words(text: str, most: int = MAX_SERVER_WORDS) -> str:
    """A server's text for a message: one line, cut past `most` characters with a mark."""
    return cut(" ".join(text.split()), most)


# (route, request field, answer field) of the tokenizers servers offer beside the OpenAI API.
TOKENIZE_ROUTES = (("/tokenize", "content", "tokens"), ("/extras/tokenize/count", "input", "count"))


@dataclass(frozen=True)
class Endpoint:
    """A server URL split into what may be shown and what must not.

    `shown` has any user:password@ replaced by ***@, and the value of every credential-like
    query parameter (?api_key=, ?key=, ?token=, ?sig=...) by ***; it is what every message,
    stats record, history row and transcript carries. `api` is the /v1 base without
    credentials or query; the query travels as `params` on every request, the credentials as
    HTTP Basic auth. Rule: when --api-key is given too, the key is sent (as a Bearer token) and
    the URL's credentials are not.
    """

    shown: str
    api: str
    username: str | None
    password: str | None
    params: tuple[tuple[str, str], ...] = ()
    secrets: tuple[str, ...] = ()  # the values that must never be shown (query credentials)


# Query parameters whose value is a credential: api_key, api-key, key, token, access_token,
# secret, password, sig(nature), auth, credential, session... (Google's ?key=, Azure's ?sig=).
_SECRET_PARAM = re.compile(
    r"(?i)^(?:.*(?:key|token|secret|passw|pwd|auth|credential|session|cookie|signature)"
    r".*|sig|pass|jwt)$"
)


def parse_endpoint(endpoint: str) -> Endpoint:
    """http://host:8080, http://u:p@host:8080/ or http://host:8080/v1?key=K -> its parts."""
    url = endpoint.strip().rstrip("/")
    ok = False
    try:
        parts = urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 (raises ValueError on a port that is no number of 0-65535)
    except ValueError as e:
        if ok and "out of range" in str(e):  # urllib's words for a number past 65535
            raise BadEndpointError(redact_url(endpoint), "a port past 65535") from None
        ok = False
    if not ok or any(c.isspace() or ord(c) < 32 for c in url):
        raise BadEndpointError(redact_url(endpoint))
    host = parts.netloc.rpartition("@")[2]
    path = parts.path.rstrip("/")
    params = tuple(parse_qsl(parts.query, keep_blank_values=True))
    secrets = tuple(v for k, v in params if v and _SECRET_PARAM.match(k))
    shown_query = urlencode(
        [(k, "***" if v and _SECRET_PARAM.match(k) else v) for k, v in params], safe="*"
    )
    shown = urlunsplit(
        (parts.scheme, ("***@" if "@" in parts.netloc else "") + host, path, shown_query, "")
    )
    base = urlunsplit((parts.scheme, host, path, "", ""))
    return Endpoint(
        shown=shown,
        api=base if base.endswith("/v1") else base + "/v1",
        username=unquote(parts.username) if parts.username is not None else None,
        password=unquote(parts.password) if parts.password is not None else None,
        params=params,
        secrets=secrets,
    )


def redact_url(text: str) -> str:
    """Every user:password@ in a text (URLs in messages too) replaced by ***@, every
    credential-like query value by ***, and every Authorization header's value by ***."""
    text = _USERINFO.sub(r"\1***@", text)
    text = _QUERY_SECRET.sub(
        lambda m: m.group(1) + ("***" if _SECRET_PARAM.match(unquote(m.group(2))) else m.group(3)),
        text,
    )
    return _AUTH_VALUE.sub(r"\1***", text)


_USERINFO = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@\s]*@")
_QUERY_SECRET = re.compile(r"([?&;]([^=&;#\s?]+)=)([^&;#\s'\"]*)")
_AUTH_VALUE = re.compile(
    r"(?i)((?:authorization|proxy-authorization|x-api-key|api-key)[\"']?\s*[:=]\s*[\"']?"
    r"(?:(?:basic|bearer|token|digest)\s+)?)[^\s\"',;}]+"
)


@dataclass(frozen=True)
class ViaProxy:
    """The proxy the environment routes a server's requests through: its URL (credentials
    redacted) and the variable that named it."""

    shown: str
    variable: str

    def __str__(self) -> str:
        return f"the proxy {self.shown} ({self.variable})"


def _setting(variable: str, value: str) -> str:
    """A variable and its value for a message: credentials redacted, a long value cut (the
    message's line, escape sequences taken out, is cli/errors.py's)."""
    return f"{variable}='{cut(redact_url(value), 200)}'"


def _proxy_variable(scheme: str) -> str:
    """The variable urllib took the proxy for `scheme` (http, https, all, no) from: the lower
    case name where it is set, as urllib.request.getproxies_environment prefers it."""
    lower = f"{scheme}_proxy"
    return lower if os.environ.get(lower) else lower.upper()


def environment_proxy(api: str) -> ViaProxy | None:
    """The proxy the environment sets for the server at `api` (HTTP_PROXY, HTTPS_PROXY,
    ALL_PROXY and NO_PROXY, read as httpx reads them), None for none. httpx builds a transport
    for every proxy the environment names, whatever the server's scheme, and failed on one it
    cannot use with ValueError, InvalidURL or ImportError: each is EnvironmentSettingError here,
    naming the variable."""
    from .httpx_adapter import URLPattern, get_environment_proxies

    patterns: list[tuple[URLPattern, ViaProxy | None]] = []
    for key, url in get_environment_proxies().items():
        scheme = key.partition("://")[0]
        variable = _proxy_variable(scheme if url is not None else "no")
        value = os.environ.get(variable, url or key)
        try:
            pattern = URLPattern(key)
            proxy = None if url is None else httpx.Proxy(url=url)
        except (ValueError, httpx.InvalidURL) as e:
            if url is not None and str(e).startswith("Unknown scheme"):  # httpx.Proxy's
                problem = "a proxy scheme httpx cannot use (it takes http, https, socks5, socks5h)"
            else:
                problem = f"not a URL httpx can read ({cut(redact_url(str(e)), 200)})"
            raise EnvironmentSettingError(f"{_setting(variable, value)}: {problem}") from None
        if proxy is not None and proxy.url.scheme in ("socks5", "socks5h"):
            import importlib.util

            if importlib.util.find_spec("socksio") is None:
                raise EnvironmentSettingError(
                    f"{_setting(variable, value)}: a SOCKS proxy, which needs the socksio"
                    " package (pip install socksio), not installed"
                )
        shown = None if proxy is None else ViaProxy(redact_url(str(proxy.url)), variable)
        patterns.append((pattern, shown))
    target = httpx.URL(api)
    for pattern, via in sorted(patterns, key=lambda p: p[0]):  # as httpx matches its mounts
        if pattern.matches(target):
            return via
    return None


def _ca_variable() -> tuple[str, str] | None:
    """The variable the HTTP client takes its CA certificates from (SSL_CERT_FILE, else
    SSL_CERT_DIR) and its value; EnvironmentSettingError for a path no file or folder of
    certificates is at (a FIFO waited for its writer for ever; /dev/zero was read)."""
    for variable, want, kind in (
        ("SSL_CERT_FILE", stat.S_ISREG, "a regular file"),
        ("SSL_CERT_DIR", stat.S_ISDIR, "a folder"),
    ):
        value = os.environ.get(variable)
        if not value:
            continue
        try:
            mode = os.stat(value).st_mode
        except OSError as e:
            raise EnvironmentSettingError(
                f"{_setting(variable, value)}: {e.strerror or e} (it names the CA certificates)"
            ) from None
        if not want(mode):
            raise EnvironmentSettingError(
                f"{_setting(variable, value)}: not {kind} of CA certificates"
            )
        return variable, value
    return None


def _header_safe(value: str) -> bool:
    """Whether an HTTP header can carry `value` as it is (RFC 9110 field values: visible ASCII
    and inner spaces; obs-text is refused by httpx too)."""
    return value == value.strip(" \t") and all(" " <= c <= "~" for c in value)


def _escaped(secret: str) -> tuple[str, ...]:
    """A secret as Python's reprs of its text and of its UTF-8 bytes write it."""
    return (repr(secret)[1:-1], repr(secret.encode("utf-8", "surrogateescape"))[2:-1])


def _read_capped(
    response: httpx.Response, limit: int, within_s: float | None = None
) -> tuple[bytes, bool]:
    """At most `limit` bytes of a streamed body, and whether that was all of it: a server's
    reply is read no further than llmrun could use, however much it sends. With `within_s`,
    the whole body must come in that time (httpx's timeout is per read: a byte every few
    seconds never trips it): httpx.ReadTimeout after it."""
    raw = bytearray()
    deadline = None if within_s is None else time.monotonic() + within_s
    for piece in response.iter_bytes():
        raw += piece
        if len(raw) > limit:
            return bytes(raw[:limit]), False
        if deadline is not None and time.monotonic() > deadline:
            raise httpx.ReadTimeout(f"the body took more than {within_s:g} s")
    return bytes(raw), True


class LongInteger(float):
    """An integer in a server's JSON past the 4,300 digits Python reads (`int` raises
    ValueError there; RFC 8259 sets no limit): valid JSON, so not a malformed answer, but no
    count any request could have. It reads as an infinite number, which every figure check
    refuses (`_number`), and keeps its text for the note that names it; `str` and `repr` give
    that text (cut as a server's words are, not `inf`: an error message may be such a number),
    and a copy or a pickle keeps it."""

    text: str

    def __new__(cls, text: str) -> LongInteger:
        number = super().__new__(cls, "-inf" if text.startswith("-") else "inf")
        number.text = text
        return number

    def __str__(self) -> str:
        return server_words(self.text)

    __repr__ = __str__

    def __reduce__(self) -> tuple[type[LongInteger], tuple[str]]:
        return LongInteger, (self.text,)


def server_value(value: Any) -> str:
    """A value from a server's JSON as its words for a message, cut once (a LongInteger's
    whole text is cut here, not its already cut `str`)."""
    return server_words(value.text if isinstance(value, LongInteger) else str(value))


def _integer(text: str) -> int | float:
    try:
        return int(text)
    except ValueError:  # past sys.get_int_max_str_digits()
        return LongInteger(text)


def server_json(text: str | bytes) -> Any:
    """JSON a server sent, as json.loads reads it but for an integer too long for Python's
    int (a LongInteger). ValueError (JSONDecodeError) and RecursionError as json.loads.
    json.loads reads it first: a parse_int hook makes a reply of 16 MiB of token ids about
    3 times slower, so it reads again with one only when an integer was too long."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except ValueError:  # "Exceeds the limit (4300 digits) for integer string conversion"
        return json.loads(text, parse_int=_integer)


def _server_message(response: httpx.Response) -> str:
    """The error text a server put in its body (OpenAI's {"error": {"message"}} and others)."""
    try:
        raw, _whole = _read_capped(response, 65536)  # an error body is short: the rest is cut
        body = raw.decode("utf-8", errors="replace")
    except (httpx.HTTPError, httpx.StreamError):
        return ""
    try:
        data = server_json(body)
    except (ValueError, RecursionError):
        return server_words(body, 200)
    if isinstance(data, dict):
        err = data.get("error", data.get("detail", data.get("message")))
        if isinstance(err, dict):
            err = err.get("message", err)
        if isinstance(err, list) and err and isinstance(err[0], dict):
            err = err[0].get("msg", err[0])
        if err:
            return server_value(err)
    return server_words(body, 200)


@dataclass(frozen=True)
class Chunk:
    """One parsed stream event: new text, or the end (finish reason, usage, timings, error)."""

    text: str = ""
    reasoning: str = ""  # the server's separate thinking text (reasoning_content / reasoning)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None  # the stream broke off; the text so far stands


class Connection:
    """An HTTP client for one server: auth, timeouts, and errors turned into ServerError."""

    def __init__(
        self,
        endpoint: str,
        *,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_connections: int = 100,
    ) -> None:
        parsed = parse_endpoint(endpoint)
        if api_key is not None and not _header_safe(api_key):
            # h11 refuses such a header, and its message would show the key
            raise OptionError(
                "the API key (--api-key, LLMRUN_API_KEY) holds what an HTTP header cannot carry:"
                " a control character, a character past ASCII, or a space at either end"
            )
        self.endpoint = parsed.shown
        self.api = parsed.api
        self.timeout_s = timeout_s
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        auth = None
        secrets = [api_key, parsed.password, *parsed.secrets]
        if parsed.username or parsed.password:
            basic = f"{parsed.username or ''}:{parsed.password or ''}".encode()
            # A server that echoes the Authorization header gives the credentials back encoded.
            encoded = base64.b64encode(basic).decode()
            secrets += [encoded, base64.urlsafe_b64encode(basic).decode(), encoded.rstrip("=")]
            if not api_key:
                auth = httpx.BasicAuth(parsed.username or "", parsed.password or "")
        # Each also as Python escapes it (a library's message may show a header's bytes), longest
        # first, so a secret that contains another is taken out whole; the user name last (it is
        # not secret, but may be part of one).
        forms = {v for x in secrets if x for v in (x, *_escaped(x)) if len(v) >= 3}
        self._secrets = sorted(forms, key=len, reverse=True)
        self._secrets += [parsed.username] if parsed.username and len(parsed.username) >= 3 else []
        # The environment's proxy and certificates, checked before httpx reads them: its
        # errors named no variable (ImportError, InvalidURL, an SSLError "writing the output").
        self.proxy = environment_proxy(self.api)
        ca = _ca_variable()
        try:
            self.client = httpx.Client(
                headers=headers,
                auth=auth,
                params=list(parsed.params),
                timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
                limits=httpx.Limits(
                    max_connections=max_connections, max_keepalive_connections=max_connections
                ),
            )
        except (ssl.SSLError, OSError) as e:
            if ca is None:
                raise
            reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or str(e)
            raise EnvironmentSettingError(
                f"{_setting(*ca)}: no CA certificates llmrun can use ({reason})"
            ) from None

    def close(self) -> None:
        self.client.close()

    def _unreachable(self, problem: str) -> ServerUnreachableError:
        """Through a proxy, a connection that fails is the proxy's to blame, not the server's."""
        if self.proxy is None:
            return ServerUnreachableError(self.endpoint, problem)
        return ProxyUnreachableError(self.endpoint, problem, self.proxy.variable)

    def _fail(self, e: Exception) -> ServerError:
        to = "" if self.proxy is None else f" to {self.proxy}"
        if isinstance(e, httpx.ConnectError):
            reason = self.scrub(str(e)) or "connection failed"
            if "refused" in reason.lower() or "errno 111" in reason.lower():
                reason = "connection refused"
            return self._unreachable(f"cannot connect{to} ({reason})")
        if isinstance(e, httpx.ConnectTimeout):
            return self._unreachable(f"cannot connect{to} (timed out)")
        if isinstance(e, httpx.ProxyError):
            return self._unreachable(f"{self.proxy or 'the proxy'} failed: {self.scrub(str(e))}")
        if isinstance(e, httpx.TimeoutException):
            return ServerTimeoutError(self.endpoint, self.timeout_s)
        return ServerError(self.endpoint, self.scrub(f"{type(e).__name__}: {e}"))

    def scrub(self, text: str) -> str:
        """A server's or a library's words with our credentials taken out, should they echo
        them: URL credentials and query keys, Authorization values, and the secrets themselves
        (plain or as the base64 of Basic auth)."""
        return self.scrub_secrets(redact_url(text))

    def _whole_reply(self, response: httpx.Response) -> Chunk:
        """A reply sent as one JSON object in spite of "stream": true: one chunk with it all."""
        try:
            raw, whole = _read_capped(response, MAX_SSE_LINE)
            if not whole:
                return Chunk(error=f"a reply longer than {MAX_SSE_LINE // 2**20} MiB")
            event = server_json(raw.decode("utf-8", errors="replace"))
        except httpx.HTTPError as e:
            return Chunk(error=self._fail(e).problem)
        except (ValueError, RecursionError):
            return Chunk(error="the server's reply is not valid JSON")
        chunk = _parse(event)
        if not chunk.error and chunk.finish_reason is None:
            chunk = dataclasses.replace(chunk, finish_reason="stop")
        return chunk

    def _silence(self, reader: SSEReader) -> str:
        """Why no event came within the timeout: only comments, a line still arriving, or an
        event whose `data` lines came without the blank line that ends it."""
        if not reader.unfinished_chars:
            return f"no reply for {self.timeout_s:g} s (the server sent only keep-alive comments)"
        n = reader.unfinished_chars
        size = f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n:,} characters"
        what = (
            f"a stream line of {size} so far, without its end"
            if reader.in_line
            else f"an event of {size} so far, without the blank line that ends it"
        )
        return f"no whole event within {self.timeout_s:g} s ({what})"

    def scrub_secrets(self, text: str) -> str:
        """Generated text with only our own secrets taken out (a URL in it stays as written)."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _http_error(self, response: httpx.Response, path: str) -> ServerError:
        """An error status, with the server's own words where its body has them."""
        message = self.scrub(_server_message(response)) or server_words(response.reason_phrase)
        return ServerError(self.endpoint, f"HTTP {response.status_code} from /v1{path}: {message}")

    def get_json(self, path: str, *, timeout_s: float | None = None) -> Any:
        url, timeout = self.api + path, timeout_s or self.timeout_s
        try:
            with self.client.stream("GET", url, timeout=timeout) as response:
                if response.status_code >= 400:
                    raise self._http_error(response, path)
                raw, whole = _read_capped(response, MAX_JSON_REPLY, timeout)
        except httpx.HTTPError as e:
            raise self._fail(e) from None
        if not whole:
            raise ServerError(
                self.endpoint, f"/v1{path} answered with over {MAX_JSON_REPLY // 2**20} MiB"
            )
        try:
            return server_json(raw)
        except (ValueError, RecursionError):
            raise ServerError(self.endpoint, f"/v1{path} did not answer with JSON") from None

    def side_json(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any | None:
        """A best-effort side request (tokenize, props): None if the server has no such route,
        or answers with no JSON, or with more than such an answer could be."""
        try:
            with self.client.stream(method, url, json=body, timeout=SIDE_REQUEST_S) as response:
                # read even when refused: a body left unread closes the kept-alive connection,
                # and the next request would time a new connection's set-up in its TTFT
                raw, whole = _read_capped(response, MAX_JSON_REPLY, SIDE_REQUEST_S)
            return server_json(raw) if whole and response.status_code < 400 else None
        except (httpx.HTTPError, ValueError, RecursionError):
            return None

    def stream(
        self, path: str, body: dict[str, Any], cancel: threading.Event | None = None
    ) -> Iterator[Chunk]:
        """POST a streaming request and yield its chunks.

        Raises ServerError before the first chunk (unreachable, HTTP error status); a failure
        after that is yielded as a final Chunk with `error`, so callers keep the partial text.
        The stream is read as the WHATWG HTML standard defines server-sent events (see
        `SSEReader`); `timeout_s` bounds the wait for the next event, and comments
        (": keep-alive") do not reset it, so a server that only keeps the line open times out.
        """
        request = self.client.build_request("POST", self.api + path, json=body)
        try:
            response = self.client.send(request, stream=True)
        except httpx.HTTPError as e:
            raise self._fail(e) from None
        try:
            if response.status_code >= 400:
                raise self._http_error(response, path)
            if 300 <= response.status_code < 400:  # not followed: the body would go elsewhere
                where = server_words(self.scrub(response.headers.get("location", "")), 200)
                where = where or "elsewhere"
                raise ServerError(
                    self.endpoint,
                    f"HTTP {response.status_code} from /v1{path}:"
                    f" redirected to {where} (use that server)",
                )
            media = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if media == "application/json":
                yield self._whole_reply(response)  # a server that does not stream
                return
            if media in ("text/html", "application/xhtml+xml"):  # a web page: no API there
                raise ServerError(
                    self.endpoint,
                    f"HTTP {response.status_code} from /v1{path}: a web page, not an event"
                    " stream (is --endpoint the server's OpenAI-compatible API?)",
                )
            finished = False
            deadline = time.monotonic() + self.timeout_s
            reader = SSEReader()
            try:
                for data in reader.events(response.iter_bytes()):
                    if cancel is not None and cancel.is_set():
                        return
                    if not data or data.isspace():  # a comment, a partial or an empty event
                        if time.monotonic() > deadline:
                            yield Chunk(error=self._silence(reader))
                            return
                        continue
                    deadline = time.monotonic() + self.timeout_s
                    if data.strip() == "[DONE]":
                        finished = True
                        break
                    try:
                        event = server_json(data)
                    except (ValueError, RecursionError):
                        yield Chunk(error=f"malformed stream line: {data[:80]!r}")
                        return
                    chunk = _parse(event)
                    yield chunk
                    if chunk.error:
                        return
                    finished = finished or chunk.finish_reason is not None
            except SSELineTooLongError as e:
                yield Chunk(error=str(e))
                return
            except httpx.HTTPError as e:
                problem = self._fail(e).problem
                if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError)):
                    problem = "the server closed the stream in the middle of the reply"
                yield Chunk(error=problem)
                return
            if not finished:
                yield Chunk(error="the stream ended before the server finished the reply")
        finally:
            response.close()


MAX_SSE_LINE = 16 * 2**20  # bytes in one line of the stream before it is refused
SIDE_REQUEST_S = 5.0  # a courtesy request (/props, /tokenize), whole, before it is let go
MAX_JSON_REPLY = MAX_SSE_LINE  # bytes of a whole JSON reply (/v1/models, /props, /tokenize)


class SSELineTooLongError(ValueError):
    pass


_LINE_END = re.compile(r"\r\n|\r|\n")


class SSEReader:
    """Reads a server-sent event stream as the WHATWG HTML standard (9.2.6) parses it.

    `events(raw)` yields the `data` of each event, and None for every comment or partial read,
    so the caller can check its deadline while a server only keeps the connection open;
    `unfinished_chars` and `in_line` then tell a line or an event still arriving from a
    server that is silent.

    Lines end with CRLF, LF or CR; one leading BOM is dropped; a line starting with ':' is a
    comment; `field: value` drops one space after the colon; several `data` lines make one
    event joined by LF, dispatched at a blank line; `event`, `id`, `retry` and unknown fields
    are ignored. Bytes are UTF-8 with errors replaced. One departure: data still pending when
    the stream ends is dispatched (the standard discards it), so a server that leaves out the
    final blank line loses nothing. Each byte is looked at once (a 10 MB line costs what its
    bytes cost), and a line or an event over MAX_SSE_LINE raises SSELineTooLongError.
    """

    def __init__(self) -> None:
        self._line: list[str] = []  # the line being received, in pieces
        self._line_chars = 0
        self._data: list[str] = []  # the event being built
        self._data_chars = 0

    @property
    def unfinished_chars(self) -> int:
        """Characters received of a line or an event not yet complete."""
        return self._line_chars + self._data_chars

    @property
    def in_line(self) -> bool:
        """Whether part of a line has come without its end."""
        return self._line_chars > 0

    def events(self, raw: Iterable[bytes]) -> Iterator[str | None]:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        started, pending_cr = False, False
        for piece in itertools.chain(raw, [None]):
            final = piece is None
            text = decoder.decode(b"" if piece is None else piece, final=final)
            if not started and text:
                text, started = text.removeprefix("\ufeff"), True
            if pending_cr and text.startswith("\n"):
                text = text[1:]  # the LF of a CRLF split across reads
            pending_cr = text.endswith("\r")
            dispatched = False
            start = 0
            for end in _LINE_END.finditer(text):
                line = "".join([*self._line, text[start : end.start()]])
                self._line, self._line_chars, start = [], 0, end.end()
                event = self._take(line)
                if event is not None:
                    yield event
                    dispatched = True
            if start < len(text):
                self._line.append(text[start:])
                self._line_chars += len(text) - start
                if self._line_chars > MAX_SSE_LINE:
                    raise SSELineTooLongError(
                        f"a stream line longer than {MAX_SSE_LINE // 2**20} MiB"
                        " (the server sent no line end)"
                    )
            if final:
                line = "".join(self._line)
                self._line, self._line_chars = [], 0
                name, _, value = line.partition(":")
                if name == "data":
                    self._data.append(value[1:] if value.startswith(" ") else value)
                if self._data:
                    yield "\n".join(self._data)
                return
            if not dispatched:
                yield None

    def _take(self, line: str) -> str | None:
        """One whole line: the event's data when the line is blank and ends one."""
        if not line:
            data, self._data, self._data_chars = self._data, [], 0
            return "\n".join(data) if data else None
        if line.startswith(":"):
            return None
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_chars += len(value) + (1 if self._data else 0)  # joined by LF
            self._data.append(value)
            if self._data_chars > MAX_SSE_LINE:
                raise SSELineTooLongError(
                    f"a stream event longer than {MAX_SSE_LINE // 2**20} MiB"
                    " (the server sent no blank line to end it)"
                )
        return None


def _parse(event: Any) -> Chunk:
    if not isinstance(event, dict):
        return Chunk(error="malformed stream event")
    if "error" in event:
        err = event["error"]
        message = err.get("message", err) if isinstance(err, dict) else err
        return Chunk(error=f"the server reported an error mid-stream: {server_value(message)}")
    text, reasoning, finish = "", "", None
    choices = event.get("choices")
    choices = [] if choices is None else choices  # [], null or none: an event of usage alone
    if not isinstance(choices, list) or (choices and not isinstance(choices[0], dict)):
        return Chunk(error=f"malformed stream event: choices is {json_kind(choices, depth=1)}")
    if choices:
        choice = choices[0]
        delta = choice.get("delta", choice.get("message"))  # message: a reply not streamed
        source = delta if isinstance(delta, dict) else {"content": choice.get("text")}
        content = _text_parts(source.get("content"))
        if content is not None and not isinstance(content, str):
            return Chunk(
                error=f"malformed stream event: the content is {json_kind(content, depth=1)}"
            )
        text = content or ""
        thought = source.get("reasoning_content", source.get("reasoning"))
        reasoning = thought if isinstance(thought, str) else ""
        reason = choice.get("finish_reason")
        finish = reason if isinstance(reason, str) else None
    usage = event.get("usage") if isinstance(event.get("usage"), dict) else None
    timings = event.get("timings") if isinstance(event.get("timings"), dict) else None
    return Chunk(text=text, reasoning=reasoning, finish_reason=finish, usage=usage, timings=timings)


def _text_parts(content: Any) -> Any:
    """A content given as a list of parts (`[{"type": "text", "text": ...}]`, as some servers
    stream it, Mistral's with thinking parts beside) as its text parts joined; anything else as
    it came."""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        texts = [p.get("text") for p in content if p.get("type", "text") == "text"]
        if all(isinstance(t, str) for t in texts):
            return "".join(texts)
    return content


def request_body(request: Request, model: str) -> tuple[str, dict[str, Any]]:
    """The route and JSON body for a request: chat messages, or a plain completion."""
    sp: SamplingParams = request.sampling
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": sp.max_tokens,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "top_k": sp.top_k,
        "min_p": sp.min_p,
    }
    if sp.repeat_penalty != 1.0:
        body["repeat_penalty"] = sp.repeat_penalty  # llama.cpp's name
        body["repetition_penalty"] = sp.repeat_penalty  # vLLM's name
    if sp.seed is not None:
        body["seed"] = sp.seed
    if sp.stop:
        body["stop"] = list(sp.stop)
    if sp.ignore_eos:
        body["ignore_eos"] = True
    if request.token_ids is not None:
        return "/completions", {**body, "prompt": list(request.token_ids)}
    if request.prompt is not None:
        return "/completions", {**body, "prompt": request.prompt}
    messages = [{"role": m.role, "content": m.content} for m in request.messages]
    if sp.think is not None:  # the template's switch, where the server passes it on
        body["chat_template_kwargs"] = {"enable_thinking": sp.think}
    return "/chat/completions", {**body, "messages": messages}


@dataclass
class _Received:
    """What a streamed answer brought: each text chunk's time and text, the server's finish
    reason (a later usage-only chunk has none), its usage and timings, or why reading stopped."""

    times: list[float] = dataclasses.field(default_factory=list)
    parts: list[str] = dataclasses.field(default_factory=list)
    reason: str | None = None
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    error: str | None = None

    def finish(self, cancel: threading.Event) -> str:
        if self.error is not None:
            return FINISH_INCOMPLETE
        if cancel.is_set():
            return FINISH_INTERRUPTED
        return FINISH_LENGTH if self.reason == "length" else FINISH_STOP


class OpenAIRunner:
    """A Runner over an OpenAI-compatible HTTP server; the server keeps its own caches."""

    def __init__(
        self,
        endpoint: str,
        *,
        model: str | None = None,
        api_key: str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        n_ctx: int | None = None,
        max_connections: int = 100,
    ) -> None:
        """`max_connections` bounds requests in flight when several threads share the runner
        (the serving benchmark); one request at a time needs one."""
        self.conn = Connection(
            endpoint, api_key=api_key, timeout_s=timeout_s, max_connections=max_connections
        )
        self.endpoint = self.conn.endpoint  # credentials redacted
        # The model's id as the server knows it, sent in every request; `model_name` is the
        # one shown and stored: scrubbed of our secrets (a server may list an id that echoes
        # the Authorization header it was sent).
        self._model_id = model
        self.model_name = self.conn.scrub(model) if model is not None else None
        self._n_ctx = n_ctx or 0
        self._loaded: ModelLoaded | None = None
        self._tokenize_routes = list(TOKENIZE_ROUTES)  # narrowed to the one that answers

    @property
    def loaded(self) -> ModelLoaded | None:
        return self._loaded

    def load(self) -> ModelLoaded:
        """Ask the server for its models (the connection check); load_s is that round trip."""
        if self._loaded is not None:
            return self._loaded
        t0 = time.perf_counter()
        listing = self.conn.get_json("/models")
        load_s = time.perf_counter() - t0
        models = listing.get("data", []) if isinstance(listing, dict) else None
        if not isinstance(models, list):
            said = (
                f"an object whose 'data' is {json_kind(models, depth=1)}"
                if isinstance(listing, dict)
                else json_kind(listing, depth=1)
            )
            raise ServerError(
                self.endpoint,
                f'/v1/models answered with {said}, not OpenAI\'s {{"data": [...]}} list of models',
            )
        ids = [m.get("id") for m in models if isinstance(m, dict)]
        ids = [i for i in ids if isinstance(i, str) and i]
        name = self._model_id or (ids[0] if ids else None)
        if not name:
            raise NoServerModelError(self.endpoint)
        if self._model_id is None and len(name) > MAX_MODEL_ID:
            raise ServerError(
                self.endpoint,
                f"/v1/models lists a first model id of {len(name):,} characters, not a name"
                f" (at most {MAX_MODEL_ID} are taken); name the model with -m",
            )
        self._model_id = str(name)
        self.model_name = self.conn.scrub(self._model_id)  # the one place the id is read
        if not self._n_ctx:
            self._n_ctx = self._server_n_ctx()
        host = urlsplit(self.conn.api).netloc
        self._loaded = ModelLoaded(
            model=None,
            settings=ServerSettings(
                endpoint=self.endpoint, host=host, model=self.model_name, n_ctx=self._n_ctx
            ),
            load_s=load_s,
        )
        return self._loaded

    def _server_n_ctx(self) -> int:
        """llama.cpp's server tells its context size at /props; others do not (0: unknown)."""
        props = self.conn.side_json("GET", self.conn.api.removesuffix("/v1") + "/props")
        settings = props.get("default_generation_settings", {}) if isinstance(props, dict) else {}
        n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
        return min(_count(n_ctx) or 0, 2**31 - 1)

    def count_tokens(self, request: Request) -> int:
        """The prompt's tokens by the server's tokenizer where it offers one (estimate: words)."""
        self.load()
        if request.token_ids is not None:
            return len(request.token_ids)
        text = (
            request.prompt
            if request.prompt is not None
            else "\n".join(m.content for m in request.messages)
        )
        return self._count_text_tokens(text)

    def _count_text_tokens(self, text: str) -> int:
        """Tokens in `text` by the server's tokenizer (llama.cpp's /tokenize, llama-cpp-python's
        /extras/tokenize/count); a word count when it has neither. The route that answered is
        remembered, so later counts cost one request (or none)."""
        root = self.conn.api.removesuffix("/v1")
        most = text_tokens_most(text)
        for route, field, answer in self._tokenize_routes:
            data = self.conn.side_json("POST", root + route, {field: text, "model": self._model_id})
            value = data.get(answer) if isinstance(data, dict) else None
            # a count no tokenizer gives (negative, a fraction, more tokens than the text has
            # bytes) is no count: the route is not asked again, as one that has no tokenizer
            counted = len(value) if isinstance(value, list) else _count(value, most)
            if counted is not None and counted <= most:
                self._tokenize_routes = [(route, field, answer)]
                return counted
        self._tokenize_routes = []
        return len(text.split())

    def reset(self) -> None:
        """Nothing to do: the server manages its own KV cache."""

    def close(self) -> None:
        self.conn.close()

    def stream(self, request: Request, *, cancel: threading.Event | None = None) -> Iterator[Event]:
        cancel = cancel or threading.Event()
        if self._loaded is None:
            yield LoadStarted(self.endpoint)
            yield self.load()
        loaded = self._loaded
        assert loaded is not None and self._model_id is not None
        path, body = request_body(request, self._model_id)
        clock = PausedClock()
        got = _Received()
        times = got.times
        tagger = TokenTagger()  # thinking inside the content (<think> ... </think>)
        thinking_chunks, first_answer = 0, None
        for chunk in self.conn.stream(path, body, cancel):
            stamp = clock.now()
            got.usage = chunk.usage or got.usage
            got.timings = chunk.timings or got.timings
            if chunk.error:
                got.error = self.conn.scrub(chunk.error)
                break
            if len(times) > 2 * request.sampling.max_tokens + 16:  # every chunk is a token or more
                got.error = (
                    f"the server sent over twice the {request.sampling.max_tokens} tokens"
                    " asked for (-n); stopped reading"
                )
                break
            got.reason = chunk.finish_reason or got.reason
            if chunk.reasoning:  # the server split the thinking off itself
                times.append(stamp)
                thinking_chunks += 1
                with clock.paused():
                    yield Token(
                        len(times) - 1,
                        self.conn.scrub_secrets(chunk.reasoning),
                        stamp,
                        thinking=True,
                    )
            if chunk.text:
                times.append(stamp)
                text = self.conn.scrub_secrets(chunk.text)  # a server that echoes our headers
                got.parts.append(text)
                thinking = tagger.tag(text)
                if first_answer is None and (
                    tagger.first_answer is not None  # answer text after a </think> in the content
                    or (thinking_chunks and not thinking and text.strip())  # after reasoning deltas
                ):
                    first_answer = stamp
                with clock.paused():
                    yield Token(len(times) - 1, text, stamp, thinking=thinking)
        thinking_count = thinking_chunks + (tagger.thinking_tokens if tagger.seen_thinking else 0)
        stats = self._stats(got, got.finish(cancel), clock.wall(), request, loaded)
        if thinking_count:
            details = (got.usage or {}).get("completion_tokens_details")
            counted = _count(details.get("reasoning_tokens")) if isinstance(details, dict) else None
            if counted is not None and counted > stats.output_tokens and stats.server:
                note = f"reasoning_tokens {counted} > the {stats.output_tokens} output tokens"
                server = dataclasses.replace(
                    stats.server, implausible=(*stats.server.implausible, note)
                )
                stats, counted = dataclasses.replace(stats, server=server), None
            thought = min(counted or thinking_count, stats.output_tokens)
            stats = dataclasses.replace(stats, thinking_tokens=thought, first_answer_s=first_answer)
        yield Finished(stats, "".join(got.parts))

    def _stats(
        self, got: _Received, finish: str, e2e: float, request: Request, loaded: ModelLoaded
    ) -> GenerationStats:
        times, usage, timings = got.times, got.usage or {}, got.timings or {}
        details = usage.get("prompt_tokens_details")
        details = details if isinstance(details, dict) else {}
        timings = {
            ours: timings[theirs] for theirs, ours in LLMRUN_TIMINGS.items() if theirs in timings
        } | timings
        # Counts past what the request could hold are no counts: dropped and named.
        notes: list[str] = []
        in_most, out_most = prompt_tokens_most(request), output_tokens_most(request)
        cached = cache_n = _checked("cache_n", timings.get("cache_n"), in_most, notes)
        if cached is None:
            cached = _checked("cached_tokens", details.get("cached_tokens"), in_most, notes)
        prompt = _checked("prompt_tokens", usage.get("prompt_tokens"), in_most, notes)
        server_prompt_n = _checked("prompt_n", timings.get("prompt_n"), in_most, notes)
        if prompt is None and server_prompt_n is not None:
            prompt = server_prompt_n + (cached or 0)
            if prompt > in_most:
                notes.append(f"prompt_n {server_prompt_n} + cache_n {cached} > {in_most:,}")
                prompt = None
        completion = _checked("completion_tokens", usage.get("completion_tokens"), out_most, notes)
        reported = ServerTimings(
            prompt_n=server_prompt_n,
            prompt_ms=_number(timings.get("prompt_ms")),
            predicted_n=_checked("predicted_n", timings.get("predicted_n"), out_most, notes),
            predicted_ms=_number(timings.get("predicted_ms")),
            cache_n=cache_n,
        )
        reported, completion, implausible = check_server_figures(
            reported,
            completion,
            chunks=len(times),
            ttft_s=times[0] if times else None,
            arrival_span_s=times[-1] - times[0] if times else 0.0,
            e2e_s=e2e,
        )
        prompt_ms = reported.prompt_ms
        report = ServerReport(
            endpoint=self.endpoint,
            model=self.model_name or "",
            host=urlsplit(self.conn.api).netloc,
            usage_reported=completion is not None or prompt is not None,
            output_chunks=len(times),
            # Without usage, the output count is of stream chunks, which are not always tokens.
            output_counted_as="tokens" if completion is not None else "chunks",
            timings=reported if reported != ServerTimings() else None,
            network_queue_ms=times[0] * 1000 - prompt_ms
            if times and prompt_ms is not None
            else None,
            error=got.error,
            implausible=(*notes, *implausible),
        )
        return GenerationStats(
            finish_reason=finish,
            prompt_tokens=prompt or 0,
            reused_tokens=min(cached or 0, prompt or 0),
            output_tokens=completion if completion is not None else len(times),
            template_tokenize_s=0.0,
            # The server's own prefill time where it reports one; else unknown (0: no rate).
            prefill_s=prompt_ms / 1000 if prompt_ms is not None else 0.0,
            first_sample_s=0.0,
            itl_s=tuple(figures.itl_s(times)),  # the one definition (serving/figures.py)
            e2e_s=e2e,
            load_s=loaded.load_s,
            seed=request.sampling.seed,
            # The client's wait: network, queue and the server's tokenization included.
            first_token_s=figures.ttft_s(0.0, times),  # its clock starts as it is sent
            prefilled_tokens=server_prompt_n if prompt_ms is not None else None,
            server=report,
        )


# No machine decodes one request at more than this, or prefills at more than this (tokens/s):
# a figure above is a server's bug or a lie, not a measurement.
MAX_DECODE_TPS = 1e6
MAX_PREFILL_TPS = 1e8
SLACK_S = 0.05  # clock granularity and rounding between the server's clock and the client's


def check_server_figures(
    t: ServerTimings,
    completion: int | None,
    *,
    chunks: int,
    ttft_s: float | None,
    arrival_span_s: float,
    e2e_s: float,
) -> tuple[ServerTimings, int | None, tuple[str, ...]]:
    """A server's own figures checked against what the client saw; what cannot be true is
    dropped (None) and named, so it is never shown or stored as a measurement.

    - Its prefill ended before the first token reached the client: prompt_ms <= client TTFT.
    - Its decode took place within the request: predicted_ms <= the client's end-to-end time.
    - Tokens it produced over predicted_ms cannot reach the client spread over 100 times longer
      (the client saw them arrive over `arrival_span_s`), nor faster than any machine decodes.
    - Every content chunk carries at least one token: completion_tokens >= chunks.
    """
    notes: list[str] = []
    prompt_ms, predicted_ms, predicted_n = t.prompt_ms, t.predicted_ms, t.predicted_n
    if prompt_ms is not None and ttft_s is not None and prompt_ms / 1000 > ttft_s * 1.05 + SLACK_S:
        notes.append(f"prompt_ms {prompt_ms:g} > the client's TTFT {ttft_s * 1000:.1f} ms")
        prompt_ms = None
    elif (
        prompt_ms is not None
        and t.prompt_n
        and t.prompt_n / max(prompt_ms / 1000, 1e-12) > MAX_PREFILL_TPS
    ):
        notes.append(f"prefill of {t.prompt_n} tokens in {prompt_ms:g} ms")
        prompt_ms = None
    if predicted_ms is not None and predicted_ms / 1000 > e2e_s * 1.05 + SLACK_S:
        notes.append(f"predicted_ms {predicted_ms:g} > the client's {e2e_s * 1000:.1f} ms")
        predicted_ms = None
    elif (
        predicted_ms is not None
        and predicted_n
        and (
            predicted_n / max(predicted_ms / 1000, 1e-12) > MAX_DECODE_TPS
            or (arrival_span_s > 0.01 and predicted_ms / 1000 * 100 < arrival_span_s)
        )
    ):
        notes.append(
            f"decode of {predicted_n} tokens in {predicted_ms:g} ms (the client saw them"
            f" arrive over {arrival_span_s * 1000:.1f} ms)"
        )
        predicted_ms = None
    if completion is not None and completion < chunks:
        notes.append(f"completion_tokens {completion} < the {chunks} chunks received")
        completion = None
    if predicted_n is not None and completion is not None and predicted_n > completion + 1:
        notes.append(f"predicted_n {predicted_n} > completion_tokens {completion}")
        predicted_n = None
    checked = dataclasses.replace(
        t, prompt_ms=prompt_ms, predicted_n=predicted_n, predicted_ms=predicted_ms
    )
    return checked, completion, tuple(notes)


# Tokens a tokenizer may add to a text's own (BOS, EOS, a dummy prefix): its count is at most
# the text's UTF-8 bytes and these; a chat template (and a server's own system prompt) may add
# up to TEMPLATE_TOKENS more. Past that a server's count is no count.
SPECIAL_TOKENS = 16
TEMPLATE_TOKENS = 8192
MAX_COUNT = 2**53 - 1  # a count of any kind past this is no count (a float cannot hold it)


def _utf8_bytes(text: str) -> int:
    return len(text.encode("utf-8", errors="surrogatepass"))


def text_tokens_most(text: str) -> int:
    """The most tokens a tokenizer can make of `text` alone (/tokenize's count)."""
    return _utf8_bytes(text) + SPECIAL_TOKENS


def prompt_tokens_most(request: Request) -> int:
    """The most prompt tokens a server can have evaluated for `request`."""
    if request.token_ids is not None:
        return len(request.token_ids) + SPECIAL_TOKENS
    if request.prompt is not None:
        return text_tokens_most(request.prompt)
    return sum(_utf8_bytes(m.content) for m in request.messages) + TEMPLATE_TOKENS


def output_tokens_most(request: Request) -> int:
    """The most output tokens a server can have made: past twice the tokens asked for, the
    stream is no longer read (OpenAIRunner.stream)."""
    return 2 * max(request.sampling.max_tokens, 0) + 16


def _number(value: Any) -> float | None:
    """A figure from a server's JSON: a finite non-negative number, else None (not trusted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int):  # up to 4,300 digits (LongInteger past that), past a float
        return float(value) if 0 <= value < 10**308 else None
    return float(value) if math.isfinite(value) and value >= 0 else None


def _count(value: Any, most: int = MAX_COUNT) -> int | None:
    """A count from a server's JSON: a whole number from 0 to `most`, else None (not trusted)."""
    number = _number(value)
    if number is None or not number.is_integer() or number > most:
        return None
    return int(number)


def _checked(name: str, value: Any, most: int, notes: list[str]) -> int | None:
    """A server's count of `name`, or None with a note when it sent one that cannot be true
    (a fraction, negative, past `most`); one it did not send is None without a note."""
    counted = _count(value, most)
    if counted is None and isinstance(value, (int, float)) and not isinstance(value, bool):
        shown = value.text if isinstance(value, LongInteger) else json.dumps(value)
        digits = len(shown) - shown.startswith("-")  # the minus sign is no digit
        shown = shown if len(shown) <= 24 else f"{shown[:12]}... ({digits:,} digits)"
        notes.append(f"{name} {shown} is no count of 0 to {most:,}")
    return counted
