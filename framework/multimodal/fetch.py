"""Fetching media over HTTP(S) without becoming a proxy into the server's network.

Off unless the operator allows domains (`MediaPolicy.allowed_domains`, the serve flag
`--allowed-media-domains`). Even then (vLLM's CVE-2025-6242 is this bug):

- only http and https, only hosts on the allowlist (exact names, case-insensitive);
- the host is resolved once, and every address it resolves to must be a public unicast
  one: loopback, private, link-local (169.254.169.254, the cloud metadata service),
  shared, multicast, reserved and unspecified addresses are refused, IPv4-mapped IPv6
  included;
- the connection goes to the address that was checked, with the name only in the Host
  header and TLS's SNI, so a second DNS answer cannot redirect it (DNS rebinding);
- redirects are followed by hand, at most `max_redirects`, each one checked like the
  first URL;
- the body is read up to `max_bytes` and the whole fetch up to `timeout_s`.

The resolver and the transport are parameters, so the checks are tested without a
network (only loopback is reachable on the dev machine, and it is refused by design).
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

from portaserve.framework.errors import InvalidParameterError

#: resolver(host, port) -> the addresses the host resolves to
Resolver = Callable[[str, int], Sequence[str]]


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes


#: transport(address, port, scheme, host, path, timeout_s, max_bytes) -> Response; raises
#: OSError / socket.timeout on network failure, `BodyTooLarge` past max_bytes
Transport = Callable[[str, int, str, str, str, float, int], Response]


class BodyTooLarge(Exception):
    pass


REDIRECTS = (301, 302, 303, 307, 308)


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def is_public(address: str) -> bool:
    """Whether `address` is a public unicast address (see the module docstring)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def http_transport(address: str, port: int, scheme: str, host: str, path: str, timeout_s: float,
                   max_bytes: int) -> Response:
    """GET `path` from `address` (already checked), naming `host` in the Host header and SNI."""
    sock = socket.create_connection((address, port), timeout=timeout_s)
    try:
        if scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=host)
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
        conn.sock = sock  # connect() is never called: the socket goes to the checked address
        conn.request("GET", path or "/", headers={"Host": host if port in (80, 443) else f"{host}:{port}",
                                                  "User-Agent": "portaserve", "Accept": "image/*"})
        resp = conn.getresponse()
        length = resp.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > max_bytes:
            raise BodyTooLarge()
        body = bytearray()
        while chunk := resp.read(64 << 10):
            body += chunk
            if len(body) > max_bytes:
                raise BodyTooLarge()
        return Response(resp.status, {k.lower(): v for k, v in resp.getheaders()}, bytes(body))
    finally:
        sock.close()


def fetch(url: str, *, allowed_domains: frozenset[str], max_bytes: int, timeout_s: float, max_redirects: int,
          where: str, resolver: Resolver | None = None, transport: Transport | None = None) -> bytes:
    """The body of `url` under the rules above; InvalidParameterError (HTTP 400) naming
    `where` otherwise."""
    resolver = resolver or system_resolver
    transport = transport or http_transport
    deadline = time.monotonic() + timeout_s
    param = where.split(".")[0].split("[")[0]
    for hop in range(max_redirects + 1):
        parts = urlsplit(url)
        scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
        if scheme not in ("http", "https") or not host:
            raise InvalidParameterError(param, f"{where}: only http and https URLs can be fetched, got {url[:100]!r}")
        if not allowed_domains:
            raise InvalidParameterError(param, f"{where}: fetching media URLs is off on this server "
                                               "(the operator allows domains with --allowed-media-domains)")
        if host not in allowed_domains:
            raise InvalidParameterError(param, f"{where}: the domain {host!r} is not one of the allowed media "
                                               f"domains ({', '.join(sorted(allowed_domains))})")
        try:
            port = parts.port or (443 if scheme == "https" else 80)
        except ValueError:
            raise InvalidParameterError(param, f"{where}: the URL's port is not a number") from None
        try:
            addresses = [host] if _is_address(host) else list(resolver(host, port))
        except OSError as exc:
            raise InvalidParameterError(param, f"{where}: {host!r} does not resolve ({exc})") from None
        blocked = [a for a in addresses if not is_public(a)]
        if not addresses or blocked:
            raise InvalidParameterError(param, f"{where}: {host!r} resolves to a non-public address "
                                               f"({', '.join(blocked) or 'none'}); refused")
        left = deadline - time.monotonic()
        if left <= 0:
            raise InvalidParameterError(param, f"{where}: fetching took longer than {timeout_s:g} s")
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            resp = transport(addresses[0], port, scheme, host, path, left, max_bytes)
        except BodyTooLarge:
            raise InvalidParameterError(param, f"{where}: the media is larger than {max_bytes} bytes") from None
        except (OSError, http.client.HTTPException) as exc:
            kind = "timed out" if isinstance(exc, (socket.timeout, TimeoutError)) else f"failed ({type(exc).__name__})"
            raise InvalidParameterError(param, f"{where}: fetching {host!r} {kind}") from None
        if resp.status in REDIRECTS and "location" in resp.headers:
            url = urljoin(url, resp.headers["location"])
            continue
        if resp.status != 200:
            raise InvalidParameterError(param, f"{where}: fetching the media returned HTTP {resp.status}")
        return resp.body
    raise InvalidParameterError(param, f"{where}: more than {max_redirects} redirects")
