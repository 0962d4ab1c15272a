"""Who may talk to `llmrun serve`: browsers' origins (CORS), the Host header (DNS rebinding), and
one path per route with or without a trailing slash. As Ollama does.

A web page may send requests to any address, 127.0.0.1 included, and a simple POST (text/plain)
needs no preflight: without a check, any page a user visits could run completions on their
server. So a request that carries an `Origin` not allowed gets 403 before it reaches a route.
Allowed by default: http and https pages on localhost, 127.0.0.1 and [::1], any port;
`--allow-origin` adds others (`*`: all). Requests without `Origin` (curl, SDKs, editors) pass.

DNS rebinding makes a page's own name resolve to 127.0.0.1, so its requests are same-origin to
the browser; only their Host header still names the page's site. On a loopback address the
server answers only Host headers that name this machine's loopback (localhost, *.localhost,
127.x.x.x, [::1], any port); on any other address (`--host 0.0.0.0`) it was meant to be
reached by other names, and every Host passes.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import unquote

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmrun.runners.errors import BadRequestError
from llmrun.runners.lists import whole

ALLOW_METHODS = "GET, HEAD, POST, OPTIONS"
ALLOW_HEADERS = ("Authorization", "Content-Type", "Accept", "User-Agent", "X-Requested-With")
EXPOSE_HEADERS = "Retry-After"
MAX_AGE_S = 12 * 3600  # Ollama's; browsers cap it lower (Chrome: 2 h)
ANY_ORIGIN = "*"
_ORIGIN = re.compile(
    r"(?P<scheme>[a-z][a-z0-9+.-]*)://(?P<host>\[[0-9a-f:.]+\]|[^/:?#\[\]@\x00-\x20\x7f]+)"
    r"(?::(?P<port>[0-9]{1,5}))?",
    re.IGNORECASE,
)
_DEFAULT_PORTS = {"http": "80", "https": "443"}
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")  # RFC 3986 section 3.1
LOCAL_ORIGIN_HOSTS = ("localhost", "127.0.0.1", "[::1]")
# RFC 6454 §7 lets the header hold a list, but a browser sends one header with one origin (the
# Fetch standard): a request with more is ambiguous, and the check must not pick one of them.
ONE_ORIGIN = "a request comes from one origin, sent in one Origin header"


def normal_origin(text: str) -> str | None:
    """An origin as browsers send it (`scheme://host[:port]`, lower case, no default port), or
    None when `text` is not one (a path, a query, a trailing slash, no scheme)."""
    m = _ORIGIN.fullmatch(text.strip())
    if m is None or (m["port"] is not None and not 0 < int(m["port"]) < 65536):
        return None
    scheme, host, port = m["scheme"].lower(), m["host"].lower(), m["port"]
    if port is None or _DEFAULT_PORTS.get(scheme) == port.lstrip("0"):
        return f"{scheme}://{host}"
    return f"{scheme}://{host}:{int(port)}"


def parse_origins(values: Iterable[str]) -> frozenset[str]:
    """`--allow-origin` values: each `*`, `null`, an origin, or an origin with one `*` standing
    for any text (`https://*.example.com`, `chrome-extension://*`, `http://10.0.0.5:*`), as
    OLLAMA_ORIGINS takes them. BadRequestError names a bad one."""
    allowed = set()
    for value in values:
        text = value.strip()
        if text in (ANY_ORIGIN, "null"):
            allowed.add(text)
            continue
        origin = normal_origin(text) if "*" not in text else _pattern(text)
        if origin is None:
            raise BadRequestError(
                f"--allow-origin: {value!r} is not an origin: give"
                " scheme://host[:port] with no path, at most one * in it"
                " (or * for all)"
            )
        allowed.add(origin)
    return frozenset(allowed)


def _pattern(text: str) -> str | None:
    """An origin with one `*` (any text there), lower case; None when it is not one."""
    if text.count("*") != 1:
        return None
    head, tail = text.split("*")
    port = head.endswith(":") and not head.endswith("://")  # `:*`: any port
    normal = normal_origin(head + ("1" if port else "x") + tail)  # checked, lower case, no :443
    return None if normal is None else normal[: len(head)] + "*" + normal[len(head) + 1 :]


def _matches(pattern: str, origin: str) -> bool:
    head, _, tail = pattern.partition("*")
    return len(origin) > len(head) + len(tail) and origin.startswith(head) and origin.endswith(tail)


def local_origin(origin: str) -> bool:
    """An http(s) page on this machine's loopback names, any port: allowed by default."""
    m = _ORIGIN.fullmatch(origin)
    return (
        m is not None
        and m["scheme"].lower() in ("http", "https")
        and m["host"].lower() in LOCAL_ORIGIN_HOSTS
    )


def loopback_address(address: str) -> bool:
    """An IP address on loopback. A zone (`::1%lo`, RFC 4007) belongs to an IPv6 address
    alone, and ipaddress reads it there; `127.0.0.1%2eevil.example` is a name with %XX in it,
    no address (cutting it at `%` had made any such name loopback)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


# RFC 3986 section 3.2.2: a host is an IP-literal in brackets (IPv6, or IPvFuture) or a
# reg-name of unreserved characters, sub-delims and %XX; nothing else (`#`, `\\`, `?`, `/`, `@`,
# a space) belongs in one, and a name that holds one must not be read as its last labels.
_REG_NAME = re.compile(r"(?:[A-Za-z0-9._~!$&'()*+,;=-]|%[0-9A-Fa-f]{2})*")
_IP_LITERAL = re.compile(r"\[(?:[0-9A-Fa-f:.]+|[vV][0-9A-Fa-f]+\.[A-Za-z0-9._~!$&'()*+,;=:-]+)\]")
HOST_CHARACTERS = "letters, digits, -._~!$&'()*+,;= and %XX, or an IP address in [ ]"


def split_host(host: str) -> tuple[str, str | None] | None:
    """(host, port) of `host[:port]` (the port None without a `:`, "" when empty), or None
    when the text is no such pair: an unclosed `[`, or more after an IP-literal's `]`."""
    host = host.strip()
    if host.startswith("["):
        name, bracket, rest = host.partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        return name + bracket, rest[1:] if rest else None
    name, colon, port = host.partition(":")
    return name, port if colon else None


def host_problem(host: str | None) -> str | None:
    """Why a Host header (or a target's authority) is no host[:port] at all (RFC 9110: ASCII;
    RFC 3986: a reg-name or an IP-literal, then a port of digits, which may be empty), or
    None: such a request is malformed (400), not a foreign name (403)."""
    if host is None:
        return None
    if not host.isascii():  # a name on the wire is ASCII (punycode); h11 gives bytes as latin-1
        return "is not ASCII (a host name goes in punycode)"
    if host.strip().startswith("[") and "]" not in host:
        return "opens an IPv6 address with [ and never closes it"
    parts = split_host(host)
    if parts is None:
        return "has more than a :port after the ] of its IP address"
    name, port = parts
    if name.startswith("["):
        if ":" not in name and name[1:2] not in ("v", "V"):  # [127.0.0.1] passed as loopback
            return "puts what is no IPv6 address in [ ] (RFC 3986: an IPv4 address goes bare)"
        if not _IP_LITERAL.fullmatch(name):
            return "holds more than an IP address in its [ ]"
    elif not _REG_NAME.fullmatch(name):
        bad = next((c for c in name if not _REG_NAME.fullmatch(c)), "%")  # or a lone %
        return f"holds {bad!a}, which is no character of a host name (RFC 3986: {HOST_CHARACTERS})"
    number = whole(port or "")
    if port and (number is None or number > 65535):  # RFC 3986: port = *DIGIT
        return "has a port that is no number up to 65535"
    return None


def origin_problem(origin: str) -> str | None:
    """Why an Origin header is malformed (400) rather than foreign (403, with the
    --allow-origin that would let it in), or None."""
    if not origin.isascii():
        return "is not ASCII (a host name goes in punycode)"
    if len(origin.split()) > 1 or "," in origin:  # RFC 6454's origin-list, or a proxy's join
        return f"names more than one origin: {ONE_ORIGIN}"
    port = re.fullmatch(r"[^:/]+://[^/]*:([0-9]+)", origin.strip())
    if port is not None and (whole(port[1]) or 65536) > 65535:
        return "has a port past 65535"
    return None


def loopback_host(host: str | None) -> bool:
    """A Host header that names this machine's loopback: localhost, *.localhost (RFC 6761),
    127.x.x.x or [::1], with or without a port. No Host at all (HTTP/1.0) passes too."""
    if host is None:
        return True
    parts = split_host(host.lower())
    if parts is None:
        return False
    name, port = parts
    if port and not 1 <= (whole(port) or 0) <= 65535:  # RFC 3986: an empty port is no port
        return False
    if name.startswith("["):
        return name.endswith("]") and loopback_address(name[1:-1])
    name = name.removesuffix(".")
    return name == "localhost" or name.endswith(".localhost") or loopback_address(name)


@dataclass(frozen=True)
class Access:
    """What the server lets in: the extra origins allowed, and whether Host is checked."""

    origins: frozenset[str] = frozenset()
    check_host: bool = True

    def origin_allowed(self, origin: str) -> bool:
        if ANY_ORIGIN in self.origins or local_origin(origin):
            return True
        normal = normal_origin(origin) or origin
        return normal in self.origins or any("*" in p and _matches(p, normal) for p in self.origins)


def absolute_form(target: str) -> tuple[str, str, str] | None:
    """(scheme, authority, path) of a request target in absolute-form (`http://host:port/path`,
    RFC 9112 section 3.2.2: what clients send to a proxy), or None for any other form: a
    path (origin-form), `*`, or text that is no URI at all."""
    head = target.split("/", 1)[0]
    scheme, colon, _ = head.partition(":")
    if target.startswith("/") or not colon or not _SCHEME.fullmatch(scheme):
        return None
    rest = target[len(scheme) + 1 :]
    if not rest.startswith("//"):  # `mailto:x`, or `localhost:8080` (authority-form)
        return scheme, "", rest
    authority, _, path = rest[2:].partition("/")
    return scheme, authority, "/" + path


def origin_form(scope: Scope) -> Scope | str:
    """The request as if its target were a path. RFC 9112 section 3.2.2: a server MUST accept
    a target in absolute-form (`GET http://127.0.0.1:8080/v1/models`), and ignore the Host
    header for the authority in it; so that authority becomes the Host the checks read (the
    DNS rebinding check applies to it). A string: why the target cannot be served (400):
    authority-form (`host:port`) is CONNECT's alone and `*` OPTIONS' alone (sections 3.2.3 and
    3.2.4), and CONNECT asks for a tunnel, which no route here opens."""
    raw = scope.get("raw_path")
    target = raw.decode("latin-1") if isinstance(raw, bytes) else scope["path"]
    method = scope["method"]
    if method == "CONNECT":
        return f"CONNECT {target!a}: this server is no proxy and opens no tunnel"
    if "#" in target:  # `http://127.0.0.1#@evil/`: the # ends the authority, not the @
        return (
            f"the request target {target!a} holds a fragment (#{target.partition('#')[2]!a}):"
            " a request target has none (RFC 9112 section 3.2), a client keeps it to itself"
        )
    if target.startswith("/") or (target == "*" and method == "OPTIONS"):
        return scope
    if target == "*":
        return f"the request target '*' is for OPTIONS alone (RFC 9112 section 3.2.4), not {method}"
    parts = absolute_form(target)
    if parts is None or parts[0].lower() not in ("http", "https") or not parts[2].startswith("/"):
        return (
            f"the request target {target!a} is neither a path (/v1/...) nor an http:// or"
            " https:// URL (host:port alone is for CONNECT, RFC 9112 section 3.2.3)"
        )
    scheme, authority, path = parts
    if not authority:  # RFC 9110 section 4.2.1: such a URI is invalid
        return f"the request target {target!a} names no host after {scheme}://"
    if "@" in authority:  # RFC 9110 section 4.2.4: userinfo is deprecated, an error here
        return (
            f"the request target {target!a} carries credentials before its host"
            " (user@host): send them in an Authorization header"
        )
    problem = host_problem(authority)
    if problem is not None:
        return f"the request target {target!a}: its host {authority!a} {problem}"
    headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"host"]
    changed = {
        **scope,
        "path": unquote(path),
        "raw_path": path.encode("latin-1"),
        "headers": [*headers, (b"host", authority.encode("latin-1"))],
    }
    return changed


def strip_slashes(scope: Scope) -> Scope:
    """The request as if its path had no trailing slash: `/v1/models/` is `/v1/models`, answered
    at once (a redirect would lose a POST's body in many clients)."""
    path = scope["path"]
    if len(path) < 2 or not path.endswith("/"):
        return scope
    raw = scope.get("raw_path")
    changed = {**scope, "path": path.rstrip("/") or "/"}
    if isinstance(raw, bytes):
        changed["raw_path"] = raw.rstrip(b"/") or b"/"
    return changed


RefuseApp = Callable[[int, str], ASGIApp]


class AccessGuard:
    """ASGI middleware before every route: the Host and Origin checks (403 in OpenAI's error
    shape, reported to `refused`), CORS preflights answered, and every response to an allowed
    origin (errors and event streams too) carrying Access-Control-Allow-Origin and Vary."""

    def __init__(self, app: ASGIApp, access: Access, *, forbidden: RefuseApp) -> None:
        self.app, self.access, self.forbidden = app, access, forbidden

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        version = scope.get("http_version", "1.1")
        if not version.startswith("1."):  # h11 reads any d.d; RFC 9110 section 15.6.6
            message = f"HTTP/{version} is not served here: this server speaks HTTP/1.1 and 1.0"
            await self.forbidden(505, message)(scope, receive, send)
            return
        target = origin_form(scope)
        if isinstance(target, str):
            await self.forbidden(400, target)(scope, receive, send)
            return
        scope = strip_slashes(target)
        headers = Headers(scope=scope)
        host = headers.get("host")
        problem = host_problem(host)
        if problem is not None:
            await self.forbidden(400, f"Host {host!a} {problem}")(scope, receive, send)
            return
        if self.access.check_host and not loopback_host(host):
            await self.forbidden(
                403,
                f"Host {host!r} is not this machine's loopback: the server"
                " listens on loopback only and refuses other names (DNS"
                " rebinding); use --host to be reached by"
                " others",
            )(scope, receive, send)
            return
        if scope["path"] == "*":  # OPTIONS * (origin_form lets no other method through)
            allow = [(b"allow", ALLOW_METHODS.encode())]
            await send({"type": "http.response.start", "status": 204, "headers": allow})
            await send({"type": "http.response.body", "body": b""})
            return
        origins = headers.getlist("origin")
        if not origins:
            await self.app(scope, receive, send)
            return
        if len(origins) > 1:  # as h11 refuses a second Host: one of them must not be ignored
            sent = ", ".join(ascii(o) for o in origins)
            message = f"Origin sent {len(origins)} times ({sent}): {ONE_ORIGIN}"
            await self.forbidden(400, message)(scope, receive, send)
            return
        origin = origins[0]
        problem = origin_problem(origin)
        if problem is not None:
            await self.forbidden(400, f"Origin {origin!a} {problem}")(scope, receive, send)
            return
        if not self.access.origin_allowed(origin):
            await self.forbidden(
                403,
                f"Origin {origin!r} is not allowed: start the server with --allow-origin {origin}",
            )(scope, receive, send)
            return
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await preflight(origin, headers, send)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                cors_headers(MutableHeaders(scope=message), origin)
            await send(message)

        await self.app(scope, receive, send_with_cors)


def cors_headers(headers: MutableHeaders, origin: str) -> None:
    headers["Access-Control-Allow-Origin"] = origin
    headers["Access-Control-Expose-Headers"] = EXPOSE_HEADERS
    headers.add_vary_header("Origin")


async def preflight(origin: str, request: Headers, send: Send) -> None:
    """204 with what a browser asks before a cross-origin request: the methods, the request
    headers it named (any: the server keeps no cookies to protect), how long to cache it, and
    (Chrome's Private Network Access) that an allowed public page may reach this address."""
    asked = [h.strip() for h in request.get("access-control-request-headers", "").split(",")]
    allowed = list(ALLOW_HEADERS)
    allowed += [h for h in asked if h and h.lower() not in {a.lower() for a in allowed}]
    headers = MutableHeaders()
    cors_headers(headers, origin)
    headers["Access-Control-Allow-Methods"] = ALLOW_METHODS
    headers["Access-Control-Allow-Headers"] = ", ".join(allowed)
    headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
    if request.get("access-control-request-private-network", "").lower() == "true":
        headers["Access-Control-Allow-Private-Network"] = "true"  # Chrome: a public page's asking
    headers.add_vary_header("Access-Control-Request-Method")
    headers.add_vary_header("Access-Control-Request-Headers")
    await send({"type": "http.response.start", "status": 204, "headers": headers.raw})
    await send({"type": "http.response.body", "body": b""})
