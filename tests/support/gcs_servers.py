"""The processes behind the GCS test rig, one per subcommand; tests/support/gcs.py starts and stops them.

    emulator     gcp-storage-emulator's JSON-API server, in memory, on a free 127.0.0.1 port
    tls-proxy    the forward proxy TensorFlow's gs:// client is sent to (`https_proxy`): it answers
                 `CONNECT www.googleapis.com:443` (and storage.googleapis.com), terminates TLS with a
                 certificate of the test CA and forwards every request over plain HTTP upstream
    fault-proxy  a plain HTTP reverse proxy that injects faults (error statuses, dropped connections,
                 cut responses, delays) by rules set at run time: PUT /__rig__/faults, GET /__rig__/stats

Each binds port 0, prints `READY <port>` on stdout once it serves, and exits when the process that
started it is gone, so a test run that dies leaves no server behind.

TensorFlow's client has no endpoint setting, so it talks to "Google" through the TLS proxy. The proxy also
smooths what the emulator does not speak: TensorFlow's upload PUTs are chunked and carry Content-Length
(de-chunked here), the upload session `Location` is an http:// URL (rewritten to https:// so the PUT comes
back through this proxy), and an empty upload (a "directory marker") is finished as an empty multipart upload.
"""

from __future__ import annotations

import argparse
import asyncio
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
from urllib.parse import unquote

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "upgrade"}


# --- HTTP/1.1 messages ------------------------------------------------------------------------


class Message:
    """A request or response: start line, ordered headers and the whole (de-chunked) body."""

    def __init__(self, start: str, headers: list[tuple[str, str]], body: bytes = b""):
        self.start, self.headers, self.body = start, headers, body

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
        head.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body


async def read_message(
    reader: asyncio.StreamReader, response_to: str | None = None, writer: asyncio.StreamWriter | None = None
) -> Message | None:
    """Reads one message; None when the peer closed before a start line. `response_to`: the request method.

    A request with `Expect: 100-continue` is answered `100 Continue` on `writer` before its body is read
    (curl would otherwise wait a second before every upload).
    """
    line = await reader.readline()
    if not line.strip():
        return None
    headers = []
    while (raw := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = raw.decode("latin-1").partition(":")
        headers.append((name.strip(), value.strip()))
    message = Message(line.decode("latin-1").rstrip("\r\n"), headers)
    status = int(message.start.split()[1]) if response_to else 0
    if writer is not None and (message.get("Expect") or "").lower() == "100-continue":
        message.drop("Expect")
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
    if response_to == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return message
    if (message.get("Transfer-Encoding") or "").lower() == "chunked":
        # Chunked wins over Content-Length (RFC 9112 6.3); TensorFlow's upload PUT sends both.
        chunks = []
        while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
            chunks.append(await reader.readexactly(size))
            await reader.readline()
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass  # trailers
        message.body = b"".join(chunks)
    elif (length := message.get("Content-Length")) is not None:
        message.body = await reader.readexactly(int(length))
    elif response_to:
        message.body = await reader.read()  # HTTP/1.0: the body ends when the connection does
    return message


def _nodelay(writer: asyncio.StreamWriter) -> None:
    # Without it every small request waits for a delayed ACK (about 40 ms per request).
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


async def exchange(upstream: tuple[str, int], request: Message, timeout: float) -> Message | None:
    """One request on a fresh upstream connection (the emulator speaks HTTP/1.0); None if it closed early."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*upstream, limit=1 << 20), timeout)
    except (OSError, asyncio.TimeoutError):
        return None
    _nodelay(writer)
    try:
        request.set("Connection", "close")
        writer.write(request.encode())
        await writer.drain()
        return await asyncio.wait_for(read_message(reader, response_to=request.start.split()[0]), timeout)
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError):
        return None
    finally:
        writer.close()


def _response(status: int, reason: str, body: bytes = b"", content_type: str = "application/json") -> Message:
    return Message(f"HTTP/1.1 {status} {reason}", [("Content-Type", content_type)], body)


# --- tls-proxy --------------------------------------------------------------------------------


class TlsProxy:
    def __init__(self, upstream: tuple[str, int], context: ssl.SSLContext, timeout: float):
        self.upstream, self.context, self.timeout = upstream, context, timeout

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        try:
            first = await read_message(reader, writer=writer)
            if first is None:
                return
            method, target, _ = first.start.split(" ", 2)
            if method == "CONNECT":
                host = target.rsplit(":", 1)[0]
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                await writer.start_tls(self.context)
                first = await read_message(reader, writer=writer)
            else:  # an absolute-form request to an http:// URL
                host = re.sub(r"^https?://([^/]+).*", r"\1", target)
                first.start = re.sub(r"^(\S+) https?://[^/]+", r"\1 ", first.start)
            request = first
            while request is not None:
                response = await self.forward(host, request)
                if response is None:
                    return  # upstream dropped the connection: so does the proxy, the client retries
                writer.write(response.encode())
                await writer.drain()
                request = await read_message(reader, writer=writer)
        except (OSError, asyncio.IncompleteReadError, ssl.SSLError, ValueError):
            return
        finally:
            writer.close()

    async def forward(self, host: str, request: Message) -> Message | None:
        request.set("Host", host)
        method, target, _ = request.start.split(" ", 2)
        if method == "POST" and "uploadType=media" in target and not request.body:
            # An empty object (TensorFlow's directory marker): the emulator fails on an empty media upload.
            return await exchange(self.upstream, _as_multipart(request, target), self.timeout)
        response = await exchange(self.upstream, request, self.timeout)
        if response is not None and (location := response.get("Location")):
            response.set("Location", re.sub(r"^http://", "https://", location))
        return response


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
    return Message(start, [("Host", request.get("Host")), ("Content-Type", f"multipart/related; boundary={boundary}")], body)


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

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer)
        try:
            while (request := await read_message(reader, writer=writer)) is not None:
                method, target, _ = request.start.split(" ", 2)
                if target.startswith("/__rig__/"):
                    writer.write(self.control(method, target, request.body).encode())
                    await writer.drain()
                    continue
                line = f"{method} {unquote(target)}"
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
                    writer.write(_response(status, "Injected", body.encode()).encode())
                    await writer.drain()
                    continue
                if action in ("delay", "stall"):
                    self.stats["holding"] += 1
                    try:
                        await asyncio.sleep(float(rule.get("delay_s", 1.0)))
                    finally:
                        self.stats["holding"] -= 1
                    if action == "stall":
                        return  # storage that never answered: the request is not forwarded
                response = await exchange(self.upstream, request, self.timeout)
                if response is None:
                    return
                if action == "cut":
                    data = response.encode()
                    writer.write(data[: len(data) - max(1, len(response.body) // 2)])
                    await writer.drain()
                    return
                writer.write(response.encode())
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, ValueError):
            return
        finally:
            writer.close()


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


async def _serve(handler, stop_after: float) -> None:
    server = await asyncio.start_server(handler, "127.0.0.1", 0, limit=1 << 20, backlog=128)
    _ready(server.sockets[0].getsockname()[1])
    async with server:
        await asyncio.sleep(stop_after)


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
        server = emulator_server.create_server("127.0.0.1", 0, in_memory=True, default_bucket=args.health_bucket)
        server.start()
        _ready(server._api._httpd.server_address[1])
        threading.Event().wait()
    elif args.command == "tls-proxy":
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(args.cert)
        proxy = TlsProxy(_upstream(args.upstream), context, timeout=600)
        asyncio.run(_serve(proxy.serve, args.max_seconds))
    else:
        proxy = FaultProxy(_upstream(args.upstream), timeout=600)
        asyncio.run(_serve(proxy.serve, args.max_seconds))


if __name__ == "__main__":
    main(sys.argv[1:])
