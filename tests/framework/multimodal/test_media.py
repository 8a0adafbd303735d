"""Loading request images safely (framework/multimodal): data URLs, local files under the
allowed folder, and HTTP fetching that refuses private addresses, DNS rebinding and
redirect tricks, with size, pixel and time limits; every failure a 400 naming the part."""

from __future__ import annotations

import base64
import http.server
import io
import socket
import threading

import pytest

from portaserve.framework.errors import InvalidParameterError
from portaserve.framework.multimodal import MediaPolicy, load_image, load_image_bytes
from portaserve.framework.multimodal import fetch as fetching

PIL = pytest.importorskip("PIL.Image")
WHERE = "messages[0].content[1].image_url.url"


def _image_bytes(fmt="PNG", size=(7, 5), color=(200, 30, 90), frames=1) -> bytes:
    buf = io.BytesIO()
    img = PIL.new("RGB", size, color)
    if fmt == "GIF" and frames > 1:
        img.save(buf, format=fmt, save_all=True, append_images=[PIL.new("RGB", size, (0, 255, 0))] * (frames - 1))
    else:
        img.save(buf, format=fmt)
    return buf.getvalue()


def _data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_data_urls_of_each_format_decode_to_rgb(fmt):
    img = load_image(_data_url(_image_bytes(fmt, frames=2 if fmt == "GIF" else 1), f"image/{fmt.lower()}"),
                     MediaPolicy(), WHERE)
    assert img.mode == "RGB" and img.size == (7, 5)
    r, g, b = img.getpixel((3, 2))
    assert r > 150 and g < 90  # the first frame's color (JPEG / WebP are lossy)


@pytest.mark.parametrize("url, message", [
    ("data:image/png;base64,@@@", "not valid base64"),
    ("data:image/png,rawbytes", "base64"),
    ("data:text/plain;base64,aGk=", "is not an image"),
    (_data_url(b"\x89PNG\r\n\x1a\n garbage"), "not a readable image"),
    (_data_url(b"GIF89a" + b"\x00" * 20), "not a readable image"),
    ("ftp://example.com/a.png", "unsupported URL scheme"),
    ("", "non-empty URL"),
])
def test_bad_images_are_400s_naming_the_part(url, message):
    with pytest.raises(InvalidParameterError, match=message) as err:
        load_image(url, MediaPolicy(), WHERE)
    assert err.value.param == "messages" and WHERE in str(err.value)


def test_size_and_pixel_limits_are_checked_before_decoding():
    big = _image_bytes(size=(300, 200))
    with pytest.raises(InvalidParameterError, match="larger than 100 bytes"):
        load_image(_data_url(big), MediaPolicy(max_bytes=100), WHERE)
    with pytest.raises(InvalidParameterError, match="300 x 200 pixels, more than the limit of 1000"):
        load_image(_data_url(big), MediaPolicy(max_pixels=1000), WHERE)


def test_local_files_only_under_the_allowed_folder(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(_image_bytes())
    (tmp_path / "secret.png").write_bytes(_image_bytes())
    (allowed / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(InvalidParameterError, match="local files are off"):
        load_image(f"file://{allowed}/a.png", MediaPolicy(), WHERE)
    policy = MediaPolicy.create(allowed_local_path=allowed)
    assert load_image(f"file://{allowed}/a.png", policy, WHERE).size == (7, 5)
    assert load_image(str(allowed / "a.png"), policy, WHERE).size == (7, 5)
    for escape in (f"file://{allowed}/../secret.png", str(allowed / "link.png"), "file:///etc/passwd"):
        with pytest.raises(InvalidParameterError, match="not under the allowed local media folder"):
            load_image(escape, policy, WHERE)
    with pytest.raises(InvalidParameterError, match="cannot be read"):
        load_image(f"file://{allowed}/missing.png", policy, WHERE)


# ----- HTTP ---------------------------------------------------------------------------------


class FakeNet:
    """A resolver and a transport over a table of names and responses (no network)."""

    def __init__(self, dns: dict[str, list[str]], responses: dict[tuple[str, str], fetching.Response]):
        self.dns, self.responses, self.calls = dns, responses, []

    def resolve(self, host, port):
        if host not in self.dns:
            raise socket.gaierror("unknown host")
        return self.dns[host]

    def transport(self, address, port, scheme, host, path, timeout_s, max_bytes):
        self.calls.append((address, port, scheme, host, path))
        resp = self.responses[(host, path)]
        if isinstance(resp, Exception):
            raise resp
        if len(resp.body) > max_bytes:
            raise fetching.BodyTooLarge()
        return resp

    def policy(self, *domains, **kw):
        return MediaPolicy.create(domains, resolver=self.resolve, transport=self.transport, **kw)


PNG = _image_bytes()


def test_fetching_is_off_by_default_and_limited_to_allowed_domains():
    net = FakeNet({"img.example.com": ["93.184.216.34"]}, {("img.example.com", "/a.png"): fetching.Response(200, {}, PNG)})
    with pytest.raises(InvalidParameterError, match="fetching media URLs is off"):
        load_image("https://img.example.com/a.png", net.policy(), WHERE)
    with pytest.raises(InvalidParameterError, match="'other.example.com' is not one of the allowed media domains"):
        load_image("https://other.example.com/a.png", net.policy("img.example.com"), WHERE)
    img = load_image("https://IMG.example.com/a.png", net.policy("img.example.com"), WHERE)
    assert img.size == (7, 5)
    # connected to the address that was checked, the name only in Host / SNI
    assert net.calls == [("93.184.216.34", 443, "https", "img.example.com", "/a.png")]


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "192.168.0.5", "172.16.0.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "fe80::1", "fc00::1",
                                     "::ffff:127.0.0.1", "::ffff:169.254.169.254"])
def test_names_resolving_to_non_public_addresses_are_refused(address):
    net = FakeNet({"evil.example.com": ["93.184.216.34", address]}, {})
    with pytest.raises(InvalidParameterError, match="non-public address"):
        load_image("http://evil.example.com/a.png", net.policy("evil.example.com"), WHERE)
    assert net.calls == []  # refused before connecting anywhere


@pytest.mark.parametrize("url", ["http://127.0.0.1/a.png", "http://169.254.169.254/latest/meta-data/",
                                 "http://[::1]/a.png"])
def test_address_literals_are_refused_even_when_allowlisted(url):
    host = url.split("/")[2].strip("[]")
    net = FakeNet({host: [host]}, {})
    with pytest.raises(InvalidParameterError, match="non-public address"):
        load_image(url, net.policy(host), WHERE)


def test_redirects_are_checked_like_the_first_url():
    net = FakeNet(
        {"img.example.com": ["93.184.216.34"], "cdn.example.com": ["93.184.216.35"], "inner.example.com": ["10.0.0.7"]},
        {
            ("img.example.com", "/ok"): fetching.Response(302, {"location": "https://cdn.example.com/x.png"}, b""),
            ("cdn.example.com", "/x.png"): fetching.Response(200, {}, PNG),
            ("img.example.com", "/meta"): fetching.Response(301, {"location": "http://169.254.169.254/"}, b""),
            ("img.example.com", "/inner"): fetching.Response(307, {"location": "http://inner.example.com/"}, b""),
            ("img.example.com", "/loop"): fetching.Response(302, {"location": "/loop"}, b""),
        },
    )
    policy = net.policy("img.example.com", "cdn.example.com", "inner.example.com", "169.254.169.254")
    assert load_image("https://img.example.com/ok", policy, WHERE).size == (7, 5)
    with pytest.raises(InvalidParameterError, match="non-public address"):
        load_image("https://img.example.com/meta", policy, WHERE)
    with pytest.raises(InvalidParameterError, match="non-public address"):
        load_image("https://img.example.com/inner", policy, WHERE)
    with pytest.raises(InvalidParameterError, match="more than 3 redirects"):
        load_image("https://img.example.com/loop", policy, WHERE)
    with pytest.raises(InvalidParameterError, match="not one of the allowed"):
        load_image("https://img.example.com/ok", net.policy("img.example.com"), WHERE)  # cdn not allowed


def test_size_time_and_status_failures_are_400s():
    net = FakeNet({"img.example.com": ["93.184.216.34"]}, {
        ("img.example.com", "/big"): fetching.Response(200, {}, b"x" * 5000),
        ("img.example.com", "/slow"): socket.timeout("timed out"),
        ("img.example.com", "/gone"): fetching.Response(404, {}, b""),
        ("img.example.com", "/reset"): ConnectionResetError(),
    })
    policy = net.policy("img.example.com", max_bytes=1000)
    for path, message in (("/big", "larger than 1000 bytes"), ("/slow", "timed out"), ("/gone", "HTTP 404"),
                          ("/reset", "failed")):
        with pytest.raises(InvalidParameterError, match=message):
            load_image_bytes(f"http://img.example.com{path}", policy, WHERE)
    with pytest.raises(InvalidParameterError, match="does not resolve"):
        load_image_bytes("http://nowhere.example.com/a.png", net.policy("nowhere.example.com"), WHERE)


def test_the_default_transport_talks_http_to_the_checked_address():
    """The real transport, against a loopback server (called directly: the policy itself
    refuses loopback): Host header from the name, body bounded."""
    seen = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen["host"], seen["path"] = self.headers["Host"], self.path
            self.send_response(200)
            self.send_header("Content-Length", str(len(PNG)))
            self.end_headers()
            self.wfile.write(PNG)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        resp = fetching.http_transport("127.0.0.1", port, "http", "img.example.com", "/a.png?x=1", 5.0, 1 << 20)
        assert resp.status == 200 and resp.body == PNG
        assert seen == {"host": f"img.example.com:{port}", "path": "/a.png?x=1"}
        with pytest.raises(fetching.BodyTooLarge):
            fetching.http_transport("127.0.0.1", port, "http", "img.example.com", "/a.png", 5.0, 10)
    finally:
        server.shutdown()
