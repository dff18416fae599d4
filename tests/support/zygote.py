"""`python -m runner ARGS` without paying for TensorFlow's import in every child: a fork server.

Most of a small job's wall time in this suite is the child's start: 5-7 s of `import tensorflow` on a 2-core
machine, against 2-8 s of training. A zygote is a process that has imported TensorFlow exactly as the runner
would for a default spec (runner/job/startup.py: `before_tensorflow`, then `load_tensorflow`) and then forgets
the runner's own modules; for each command it forks a child that sets the test's argv, environment, folder and
standard streams, and runs `python -m runner` from the top (runner imports afresh, its clock starts at the
fork). The child is an ordinary process with its own PID: signals, exit codes, files, leases and its own
children behave as for `subprocess.run`. Its exit status comes back through the zygote, which reaps it.

What TensorFlow reads while it loads cannot change afterwards. So:
- the zygote loads TensorFlow for a CPU job (Keras on TensorFlow);
- one zygote per environment (less the keys nothing reads at import: `_INERT`);
- in the child, the environment the runner has made by the time it loads TensorFlow must equal the zygote's;
  if the job's spec asked for anything else (storage.timeout_s, another backend, `--debug`), the child stops
  with exit `MISMATCH` and names the variables, so that no test runs with settings it did not ask for. Such a
  command runs as a fresh child (`run_cli(..., fresh=True)`, or a spec the router sees: `needs_fresh`).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MISMATCH = 97
# Variables read at run time only (by the runner, pytest, Rich), never by TensorFlow while it loads.
_INERT_PREFIXES = ("RUNNER_", "PYTEST_")
_INERT = {"PWD", "OLDPWD", "COLUMNS", "LINES", "_"}


def _loading_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _INERT and not k.startswith(_INERT_PREFIXES)}


# --- the server ----------------------------------------------------------------------------------------------


def _prime() -> tuple[dict[str, str], dict[str, str]]:
    """Loads TensorFlow as `runner run` does for the default spec. Returns the environment it loaded under, and
    the variables its import set (TF2_BEHAVIOR, ...), which a fresh process has from then on."""
    import logging

    from runner.job import startup
    from runner.spec.load import load_spec

    # TensorFlow's backend whatever the environment says of a TPU (auto would pick JAX beside TPU_NAME): a job
    # that asks for JAX meets backend.apply's refusal ("Keras was imported with ...") and runs fresh instead.
    startup.before_tensorflow(load_spec(None, ["accelerator.kind=cpu"]))
    loaded = dict(os.environ)
    startup.load_tensorflow(False)
    set_by_import = {k: v for k, v in os.environ.items() if loaded.get(k) != v}
    for name in [n for n in sys.modules if n == "runner" or n.startswith("runner.")]:
        del sys.modules[name]
    manager = logging.root.manager
    for name in [n for n in manager.loggerDict if n == "runner" or n.startswith("runner.")]:
        del manager.loggerDict[name]
    logging.root.handlers.clear()
    return loaded, set_by_import


def _child(request: dict, loaded: dict[str, str], set_by_import: dict[str, str]) -> None:
    """Runs in the forked child: becomes `python -m runner ARGS` and never returns (SystemExit ends it)."""
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [str(REPO / "runner" / "__main__.py"), *request["args"]]
    sys.path[0] = os.getcwd()

    import runner.data.storage as storage

    def configure_tensorflow(timeout_s: float) -> None:  # the same, less the "already imported" warning
        for name, value in storage.tensorflow_env(timeout_s).items():
            os.environ.setdefault(name, value)

    storage.configure_tensorflow = configure_tensorflow
    import runner.job.startup as startup

    def load_tensorflow(debug: bool) -> None:
        now, then = _loading_env(dict(os.environ)), _loading_env(loaded)
        # The data commands set no backend: Keras's default, TensorFlow (KERAS_HOME, which could name another,
        # is part of the zygote's own environment).
        now.setdefault("KERAS_BACKEND", "tensorflow")
        differ = sorted(k for k in now.keys() | then.keys() if now.get(k) != then.get(k))
        if differ:
            sys.stderr.write(
                f"tests/support/zygote.py: TensorFlow was loaded with other values of {', '.join(differ)} than "
                "this command sets: run it with run_cli(..., fresh=True)\n")
            sys.stderr.flush()
            os._exit(MISMATCH)
        os.environ.update(set_by_import)

    startup.load_tensorflow = load_tensorflow
    runpy.run_module("runner", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve(path: str) -> None:
    loaded, set_by_import = _prime()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}

    def stop(*_: object) -> None:
        for pid in waiting:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    listener.settimeout(0.02)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            conn = None
        if conn is not None:
            conn.settimeout(10)
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                listener.close()
                for other in waiting.values():
                    other.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                conn.close()
                _child(request, loaded, set_by_import)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:
                conn.sendall(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
            except OSError:
                pass
            conn.close()
        if os.getppid() != parent:  # the suite's worker is gone
            stop()


# --- which commands it can run -----------------------------------------------------------------------------

# What in a command's words or spec makes TensorFlow load otherwise than for the default spec.
_OTHER_LOADING = ("jax", "timeout", "--debug", "backend")


# The commands that load TensorFlow. The others start in a second or two on their own: a zygote of their
# environment would cost them TensorFlow's whole import.
_LOADING = {"run", "evaluate", "predict", "prepare", "verify", "manifest"}


def needs_fresh(args: list[str], cwd: Path) -> bool:
    """True for a command that does not load TensorFlow, or one whose words or spec file mention what changes
    how it loads; the child's own check (`load_tensorflow` above) stops any other such command with MISMATCH."""
    if not args or args[0] not in _LOADING:
        return True
    for arg in args:
        if any(word in arg for word in _OTHER_LOADING):
            return True
        path = Path(cwd, arg)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            text = path.read_text(errors="replace")
            if any(word in text for word in _OTHER_LOADING):
                return True
    return False


# --- the client ----------------------------------------------------------------------------------------------


class _Zygote:
    def __init__(self, env: dict[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="runner-zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "stderr.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", self.path], cwd=REPO, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=self.log,
        )
        self.ready = False

    def wait_ready(self) -> bool:
        """True once it serves; False if this environment stops it (TF_USE_LEGACY_KERAS, say): such a command
        then runs as a fresh child, which meets the same refusal the way a user would."""
        if not self.ready:
            self.ready = self.proc.stdout.readline().strip() == b"ready"
        return self.ready

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.folder, ignore_errors=True)


_zygotes: dict[tuple, _Zygote] = {}
_lock = threading.Lock()
_MOST = 6


def _zygote_for(env: dict[str, str]) -> _Zygote | None:
    key = tuple(sorted(_loading_env(env).items()))
    with _lock:
        zygote = _zygotes.pop(key, None)
        if zygote is None or (zygote.ready and zygote.proc.poll() is not None):
            zygote = _Zygote(env)
            _trace("zygote", key=hash(key), keys=sorted(k for k, v in key if os.environ.get(k) != v))
        _zygotes[key] = zygote  # the newest last
        while len(_zygotes) > _MOST:
            _zygotes.pop(next(iter(_zygotes))).stop()
        return zygote if zygote.wait_ready() else None


def _trace(event: str, **fields: object) -> None:
    """A line per zygote started and per command run, in RUNNER_TEST_ZYGOTE_LOG when set (to see what the
    suite's commands cost)."""
    path = os.environ.get("RUNNER_TEST_ZYGOTE_LOG")
    if path:
        with open(path, "a") as log:
            log.write(json.dumps({"event": event, "at": time.time(), "pid": os.getpid(), **fields}) + "\n")


@atexit.register
def _stop_all() -> None:
    for zygote in _zygotes.values():
        zygote.stop()


def fresh(args: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m runner ARGS` started afresh, as a user starts it."""
    return subprocess.run([sys.executable, "-m", "runner", *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)


def run(args: list[str], *, env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`subprocess.run([python, -m, runner, *args], capture_output=True, text=True)` through a zygote. On a
    timeout the child is killed and subprocess.TimeoutExpired raised, with what it wrote."""
    zygote = _zygote_for(env)
    if zygote is None:
        return fresh(args, env=env, cwd=cwd, timeout=timeout)
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(zygote.path)
        request = {"args": args, "env": env, "cwd": str(cwd)}
        socket.send_fds(conn, [json.dumps(request).encode()], [null, out_w, err_w])
    except OSError:  # the zygote is gone (its socket with it): this command starts fresh
        conn.close()
        for fd in (out_r, err_r):
            os.close(fd)
        zygote.proc.kill()
        return fresh(args, env=env, cwd=cwd, timeout=timeout)
    finally:
        for fd in (null, out_w, err_w):
            os.close(fd)
    pid = json.loads(conn.recv(1 << 16))["pid"]
    chunks: dict[int, list[bytes]] = {out_r: [], err_r: []}

    def drain(fd: int) -> None:
        with os.fdopen(fd, "rb") as stream:
            for block in iter(lambda: stream.read1(1 << 16), b""):
                chunks[fd].append(block)

    readers = [threading.Thread(target=drain, args=(fd,), daemon=True) for fd in (out_r, err_r)]
    for reader in readers:
        reader.start()
    began = time.monotonic()
    conn.settimeout(timeout)
    try:
        returncode = json.loads(conn.recv(1 << 16))["returncode"]
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        conn.settimeout(30)
        conn.recv(1 << 16)  # reaped
        for reader in readers:
            reader.join(10)
        raise subprocess.TimeoutExpired(
            ["runner", *args], timeout, b"".join(chunks[out_r]), b"".join(chunks[err_r])) from None
    finally:
        conn.close()
    for reader in readers:
        reader.join(max(1.0, began + timeout - time.monotonic()))
    _trace("run", command=args[0], seconds=round(time.monotonic() - began, 2))
    # as text=True reads: the locale's UTF-8 and universal newlines
    text = {fd: b"".join(parts).decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")
            for fd, parts in chunks.items()}
    return subprocess.CompletedProcess(
        [sys.executable, "-m", "runner", *args], returncode, text[out_r], text[err_r])


if __name__ == "__main__":
    serve(sys.argv[1])
