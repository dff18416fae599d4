"""The processes behind the GCS test rig, one per subcommand; tests/support/gcs.py starts and stops them.

    emulator     gcp-storage-emulator's JSON-API server, in memory, on a free 127.0.0.1 port
    tls-proxy    the forward proxy TensorFlow's gs:// client is sent to (`https_proxy`): it answers
                 `CONNECT www.googleapis.com:443` (and storage.googleapis.com), terminates TLS with a
                 certificate of the test CA and forwards every request over plain HTTP upstream
    fault-proxy  a plain HTTP reverse proxy that injects faults (error statuses, dropped connections,
                 cut responses, delays) by rules set at run time: PUT /__rig__/faults, GET /__rig__/stats

Each binds port 0, prints `READY <port>` on stdout once it serves, and exits when the process that
started it is gone, so a test run that dies leaves no server behind. The proxies serve each connection in
its own thread with blocking sockets (the I/O runs in C, outside the GIL) and stream answers as they come.

TensorFlow's client has no endpoint setting, so it talks to "Google" through the TLS proxy. The proxy also
smooths what the emulator does not speak: TensorFlow's upload PUTs are chunked and carry Content-Length
(de-chunked here), the upload session `Location` is an http:// URL (rewritten to https:// so the PUT comes
back through this proxy), and an empty upload (a "directory marker") is finished as an empty multipart upload.
The emulator process itself answers the status query of an empty resumable upload as GCS does (no Range).
It also honours `ifGenerationMatch` on uploads, downloads and deletes (412 when it does not hold), as GCS does.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import re
import socket
import ssl
import sys
import threading
import time
import uuid
from collections.abc import Callable
from urllib.parse import unquote

# Read buffer per connection: large reads go straight from the socket into the body.
_BUFFER = 1 << 20
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}


# --- HTTP/1.1 messages ------------------------------------------------------------------------


class Message:
    """A request or response: start line, ordered headers and the whole (de-chunked) body."""

    def __init__(self, start: str, headers: list[tuple[str, str]], body: bytes = b""):
        self.start, self.headers, self.body = start, headers, body
        self.unread = 0  # body bytes left in the socket by read_message(stream=True)

    def get(self, name: str, default: str | None = None) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), default)

    def set(self, name: str, value: str) -> None:
        self.drop(name)
        self.headers.append((name, value))

    def drop(self, name: str) -> None:
        self.headers = [(k, v) for k, v in self.headers if k.lower() != name.lower()]

    def encode(self) -> bytes:
        head = [self.start, *(f"{k}: {v}" for k, v in self.headers if k.lower() not in _HOP_BY_HOP)]
        head = [h for h in head if not h.lower().startswith("content-length:")]
        head.append(f"Content-Length: {len(self.body) + self.unread}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body


class Peer:
    """One side of a connection: a blocking socket with a buffered reader (socket I/O stays in C)."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else ~40 ms of delayed ACK per request
        self.sock = sock
        self.reader = sock.makefile("rb", buffering=_BUFFER)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        for closing in (self.reader.close, self.sock.close):
            try:
                closing()
            except OSError:
                pass


def _readline(peer: Peer) -> bytes:
    line = peer.reader.readline(65536)
    if len(line) == 65536:
        raise ValueError("header line too long")
    return line


def _read_exactly(peer: Peer, size: int) -> bytes:
    data = peer.reader.read(size)
    if len(data) != size:
        raise ConnectionError(f"connection closed after {len(data)} of {size} bytes")
    return data


def read_message(
    peer: Peer, response_to: str | None = None, answer_expect: bool = False, stream: bool = False
) -> Message | None:
    """Reads one message; None when the peer closed before a start line. `response_to`: the request method.

    With `stream`, a body of known length stays in the socket (`message.unread` bytes) for `relay`.

    With `answer_expect`, a request carrying `Expect: 100-continue` is answered `100 Continue` before its
    body is read (curl would otherwise wait a second before every upload).
    """
    line = _readline(peer)
    if not line.strip():
        return None
    headers = []
    while (raw := _readline(peer)) not in (b"\r\n", b"\n", b""):
        name, _, value = raw.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    message = Message(line.decode("latin-1").rstrip("\r\n"), headers)
    status = int(message.start.split()[1]) if response_to else 0
    if answer_expect and (message.get("Expect") or "").lower() == "100-continue":
        message.drop("Expect")
        peer.send(b"HTTP/1.1 100 Continue\r\n\r\n")
    if response_to == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return message
    if (message.get("Transfer-Encoding") or "").lower() == "chunked":
        # Chunked wins over Content-Length (RFC 9112 6.3); TensorFlow's upload PUT sends both.
        chunks = []
        while size := int(_readline(peer).split(b";")[0].strip() or b"0", 16):
            chunks.append(_read_exactly(peer, size))
            _readline(peer)
        while _readline(peer) not in (b"\r\n", b"\n", b""):
            pass  # trailers
        message.body = b"".join(chunks)
    elif (length := message.get("Content-Length")) is not None:
        if stream:
            message.unread = int(length)
        else:
            message.body = _read_exactly(peer, int(length))
    elif response_to:
        message.body = peer.reader.read()  # HTTP/1.0: the body ends when the connection does
    return message


def relay(
    upstream: tuple[str, int], request: Message, client: Peer, timeout: float,
    edit: Callable[[Message], None] = lambda response: None, cut: bool = False,
) -> bool:
    """Forwards one request on a fresh upstream connection (the emulator speaks HTTP/1.0) and streams the
    answer to `client` as it arrives. False when upstream failed or `cut` sent half: drop the client then."""
    try:
        peer = Peer(socket.create_connection(upstream, timeout=timeout))
    except OSError:
        return False
    try:
        request.set("Connection", "close")
        peer.send(request.encode())
        response = read_message(peer, response_to=request.start.split()[0], stream=True)
        if response is None:
            return False
        edit(response)
        client.send(response.encode())
        remaining = response.unread // 2 if cut else response.unread
        while remaining > 0:
            chunk = peer.reader.read1(min(remaining, _BUFFER))
            if not chunk:
                return False
            client.send(chunk)
            remaining -= len(chunk)
        return not cut
    except (OSError, ValueError):
        return False
    finally:
        peer.close()


def _response(status: int, reason: str, body: bytes = b"", content_type: str = "application/json") -> Message:
    return Message(f"HTTP/1.1 {status} {reason}", [("Content-Type", content_type)], body)


# --- tls-proxy --------------------------------------------------------------------------------


class TlsProxy:
    def __init__(self, upstream: tuple[str, int], context: ssl.SSLContext, timeout: float):
        self.upstream, self.context, self.timeout = upstream, context, timeout

    def serve(self, sock: socket.socket) -> None:
        client = Peer(sock)
        try:
            first = read_message(client, answer_expect=True)
            if first is None:
                return
            method, target, _ = first.start.split(" ", 2)
            if method == "CONNECT":
                host = target.rsplit(":", 1)[0]
                client.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
                client.reader.close()
                client = Peer(self.context.wrap_socket(sock, server_side=True))
                first = read_message(client, answer_expect=True)
            else:  # an absolute-form request to an http:// URL
                host = re.sub(r"^https?://([^/]+).*", r"\1", target)
                first.start = re.sub(r"^(\S+) https?://[^/]+", r"\1 ", first.start)
            request = first
            while request is not None:
                if not self.forward(host, request, client):
                    return  # upstream dropped the connection: so does the proxy, the client retries
                request = read_message(client, answer_expect=True)
        except (OSError, ValueError):
            return
        finally:
            client.close()

    def forward(self, host: str, request: Message, client: Peer) -> bool:
        request.set("Host", host)
        method, target, _ = request.start.split(" ", 2)
        if method == "POST" and "uploadType=media" in target and not request.body:
            # An empty object (TensorFlow's directory marker): the emulator fails on an empty media upload.
            request = _as_multipart(request, target)
        return relay(self.upstream, request, client, self.timeout, edit=_https_location)


def _https_location(response: Message) -> None:
    if location := response.get("Location"):
        response.set("Location", re.sub(r"^http://", "https://", location))


def _as_multipart(request: Message, target: str) -> Message:
    query = re.sub(r"uploadType=media&?", "", target.split("?", 1)[1])
    name = unquote(re.search(r"(?:^|&)name=([^&]+)", query).group(1))
    boundary = uuid.uuid4().hex
    body = (
        f"--{boundary}\r\nContent-Type: application/json\r\n\r\n{json.dumps({'name': name})}\r\n"
        f"--{boundary}\r\nContent-Type: application/octet-stream\r\n\r\n\r\n--{boundary}--\r\n"
    ).encode()
    path = target.split("?", 1)[0]
    start = f"POST {path}?uploadType=multipart&{query} HTTP/1.1"
    headers = [("Host", request.get("Host")), ("Content-Type", f"multipart/related; boundary={boundary}")]
    return Message(start, headers, body)


# --- fault-proxy ------------------------------------------------------------------------------


class FaultProxy:
    """Forwards to the emulator; each request is checked against the rules in order, the first that fires wins.

    A rule: {"match": regex on "METHOD /path?query" (URL-decoded), "action": "status" | "drop" | "cut" |
    "delay" | "stall", "status": 503, "delay_s": 1.0, "p": probability (default 1), "times": how often at most}.
    `drop` closes the connection without an answer; `cut` sends half the response body, then closes;
    `delay` forwards after delay_s; `stall` waits delay_s, then closes without forwarding (a hung server).
    """

    def __init__(self, upstream: tuple[str, int], timeout: float):
        self.upstream, self.timeout = upstream, timeout
        self.rules: list[dict] = []
        self.hits: list[int] = []
        self.random = random.Random(0)
        self.stats = {"requests": 0, "status": 0, "drop": 0, "cut": 0, "delay": 0, "stall": 0, "holding": 0}
        self.recent: list[str] = []
        self.lock = threading.Lock()

    def control(self, method: str, target: str, body: bytes) -> Message:
        if method == "PUT" and target.startswith("/__rig__/faults"):
            doc = json.loads(body or b"{}")
            self.rules, self.hits = list(doc.get("rules", [])), [0] * len(doc.get("rules", []))
            self.random = random.Random(doc.get("seed", 0))
            return _response(200, "OK", json.dumps({"rules": len(self.rules)}).encode())
        if method == "GET" and target.startswith("/__rig__/stats"):
            doc = {**self.stats, "hits": self.hits, "recent": self.recent[-200:]}
            return _response(200, "OK", json.dumps(doc).encode())
        if method == "POST" and target.startswith("/__rig__/reset"):
            self.stats = {k: 0 for k in self.stats} | {"holding": self.stats["holding"]}
            self.recent, self.hits = [], [0] * len(self.rules)
            return _response(200, "OK", b"{}")
        return _response(404, "Not Found", b"{}")

    def pick(self, line: str) -> dict | None:
        for index, rule in enumerate(self.rules):
            if not re.search(rule.get("match", ""), line):
                continue
            if "times" in rule and self.hits[index] >= rule["times"]:
                continue
            if self.random.random() >= rule.get("p", 1.0):
                continue
            self.hits[index] += 1
            return rule
        return None

    def serve(self, sock: socket.socket) -> None:
        client = Peer(sock)
        try:
            while (request := read_message(client, answer_expect=True)) is not None:
                method, target, _ = request.start.split(" ", 2)
                if target.startswith("/__rig__/"):
                    with self.lock:
                        client.send(self.control(method, target, request.body).encode())
                    continue
                line = f"{method} {unquote(target)}"
                with self.lock:
                    self.stats["requests"] += 1
                    rule = self.pick(line)
                    action = rule["action"] if rule else "pass"
                    self.recent.append(f"{action} {line}")
                    if action != "pass":
                        self.stats[action] += 1
                if action == "drop":
                    return
                if action == "status":
                    status = int(rule.get("status", 503))
                    body = json.dumps({"error": {"code": status, "message": "injected by the fault proxy"}})
                    client.send(_response(status, "Injected", body.encode()).encode())
                    continue
                if action in ("delay", "stall"):
                    self._hold(float(rule.get("delay_s", 1.0)))
                    if action == "stall":
                        return  # storage that never answered: the request is not forwarded
                if not relay(self.upstream, request, client, self.timeout, cut=action == "cut"):
                    return
        except (OSError, ValueError):
            return
        finally:
            client.close()

    def _hold(self, seconds: float) -> None:
        with self.lock:
            self.stats["holding"] += 1
        try:
            time.sleep(seconds)
        finally:
            with self.lock:
                self.stats["holding"] -= 1


# --- process plumbing -------------------------------------------------------------------------


def _exit_with_parent() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _ready(port: int) -> None:
    print(f"READY {port}", flush=True)


def _serve(handle: Callable[[socket.socket], None]) -> None:
    """Accepts on a free 127.0.0.1 port; each connection gets its own thread (socket I/O releases the GIL)."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=128)
    _ready(listener.getsockname()[1])
    while True:
        sock, _ = listener.accept()
        threading.Thread(target=handle, args=(sock,), daemon=True).start()


def _answer_empty_upload_status_like_gcs() -> None:
    """GCS answers a status query of a resumable upload that holds no bytes yet with 308 and no Range
    header; the emulator says `Range: bytes=0-0` (one byte held), so after a failed upload PUT TensorFlow
    resumes at byte 1 and the emulator refuses it (400). Its answer is corrected to GCS's."""
    from gcp_storage_emulator.handlers import objects

    incomplete = objects._resumable_incomplete

    def answer(response, storage, upload_id, fallback_end=0):
        incomplete(response, storage, upload_id, fallback_end)
        if not storage.get_resumable_byte_count(upload_id):
            response._headers.pop("Range", None)

    objects._resumable_incomplete = answer


def _name_the_generation_of_each_download_like_gcs() -> None:
    """GCS answers a download with the object's generation in `x-goog-generation` (and `x-goog-metageneration`);
    the emulator sends neither. TensorStore (Orbax's writer) takes a read's generation from that header for its
    next conditional write: without it the generation is empty and the write fails "Malformed StorageGeneration"
    (OCDBT re-reads its manifest and writes it back so when two commits meet)."""
    from gcp_storage_emulator import server as emulator_server
    from gcp_storage_emulator.exceptions import NotFound

    def with_generation(handler):
        @functools.wraps(handler)
        def answered(request, response, storage, *args, **kwargs):
            obj = None
            try:
                if "object_id" in request.params:  # not a bucket's `get`
                    obj = storage.get_file_obj(request.params["bucket_name"], request.params["object_id"])
            except NotFound:
                pass
            if obj is not None:
                response["x-goog-generation"] = str(obj["generation"])
                response["x-goog-metageneration"] = str(obj["metageneration"])
            return handler(request, response, storage, *args, **kwargs)

        return answered

    for _, handlers in emulator_server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler.__name__ in ("get", "download"):  # `get` with alt=media downloads
                handlers[method] = with_generation(handler)


def _honour_generation_preconditions() -> None:
    """GCS refuses an upload, download or delete whose `ifGenerationMatch` does not hold with 412 (0: the object
    must not exist yet); the emulator ignores the parameter, so its object handlers are wrapped to check it.
    The emulator serves one request at a time, so the check and the write cannot interleave."""
    from http import HTTPStatus

    from gcp_storage_emulator import server as emulator_server
    from gcp_storage_emulator.exceptions import NotFound

    def generation(storage, bucket: str, name: str) -> int:
        try:
            return int(storage.get_file_obj(bucket, name)["generation"])
        except NotFound:
            return 0

    def upload_name(request) -> str | None:
        if "name" in request.query:
            return request.query["name"][0]
        meta = request.data.get("meta") if request.query.get("uploadType") == ["multipart"] else request.data
        return (meta or {}).get("name")

    def guard(handler, name_of):
        def checked(request, response, storage, *args, **kwargs):
            wanted = request.query.get("ifGenerationMatch")
            name = name_of(request) if wanted else None
            if name is not None and generation(storage, request.params["bucket_name"], name) != int(wanted[0]):
                response.status = HTTPStatus.PRECONDITION_FAILED
                response.json({"error": {
                    "code": 412, "message": "At least one of the pre-conditions you specified did not hold."}})
                return None
            return handler(request, response, storage, *args, **kwargs)

        return checked

    for _, handlers in emulator_server.HANDLERS:
        for method, handler in list(handlers.items()):
            if handler.__name__ == "insert":
                handlers[method] = guard(handler, upload_name)
            elif handler.__name__ in ("delete", "download"):
                handlers[method] = guard(handler, lambda request: request.params["object_id"])


def _upstream(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-seconds", type=float, default=6 * 3600, help="exit after this long, whatever happens")
    commands = parser.add_subparsers(dest="command", required=True)
    emulator = commands.add_parser("emulator")
    emulator.add_argument("--health-bucket", required=True, help="created at start: proves the port is this server's")
    tls = commands.add_parser("tls-proxy")
    tls.add_argument("--upstream", required=True, help="HOST:PORT of the emulator or the fault proxy")
    tls.add_argument("--cert", required=True, help="PEM with the server key and certificate chain")
    faults = commands.add_parser("fault-proxy")
    faults.add_argument("--upstream", required=True, help="HOST:PORT of the emulator")
    args = parser.parse_args(argv)
    _exit_with_parent()
    deadline = threading.Timer(args.max_seconds, lambda: os._exit(0))
    deadline.daemon = True
    deadline.start()

    if args.command == "emulator":
        from gcp_storage_emulator import server as emulator_server

        # It writes headers and body separately: with Nagle on, each answer waits 40 ms for a delayed ACK.
        emulator_server.RequestHandler.disable_nagle_algorithm = True
        _answer_empty_upload_status_like_gcs()
        _name_the_generation_of_each_download_like_gcs()
        _honour_generation_preconditions()
        server = emulator_server.create_server("127.0.0.1", 0, in_memory=True, default_bucket=args.health_bucket)
        server.start()
        _ready(server._api._httpd.server_address[1])
        threading.Event().wait()
    elif args.command == "tls-proxy":
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.cert)
        _serve(TlsProxy(_upstream(args.upstream), context, timeout=600).serve)
    else:
        _serve(FaultProxy(_upstream(args.upstream), timeout=600).serve)


if __name__ == "__main__":
    main(sys.argv[1:])
