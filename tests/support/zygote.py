"""`python -m runner ARGS` without paying for TensorFlow's import in every child: a fork server.

Most of a small job's wall time in this suite is the child's start: 5-7 s of `import tensorflow` on a 2-core
machine, against 2-8 s of training. A zygote is a process that has loaded TensorFlow as a command's start-up plan
says (runner/job/startup.py: the runner decides, `runner.cli.startup_plan` answers for a command line, and
`startup.preload` loads) and then forgets the runner's own modules; for each command it forks a child that
sets the test's argv, environment, folder and standard streams, says in RUNNER_TENSORFLOW_PRELOADED under which
plan TensorFlow was loaded, and runs `python -m runner` from the top (runner imports afresh, its clock starts at
the fork). The child is an ordinary process with its own PID: signals, exit codes, files, leases and its own
children behave as for `subprocess.run`. Its exit status comes back through the zygote, which reaps it.

What TensorFlow reads while it loads cannot change afterwards. So:
- the router (`plan_for`) asks the runner for the command's plan and nothing else: there is one zygote per
  plan (`StartupPlan.loaded_as`: the backend, the variables set before the load, the optional imports skipped)
  and environment (less the keys nothing reads at import: `_INERT`);
- in the child, the runner's own start-up (`startup.start`) compares its plan with the zygote's and, if they
  differ, stops with exit 70 naming the variables, so that no test runs with settings it did not ask for;
- the commands that load no TensorFlow, `--debug` (TensorFlow's start-up notices are the zygote's, not the
  child's) and JAX on anything but the CPU platform start fresh, as users start them; so does a command run
  with `run_cli(..., fresh=True)`, or every command under RUNNER_TEST_FRESH=1.

`popen` is `subprocess.Popen` for such a command (a subclass whose child the zygote forks and reaps: `pid`,
`send_signal`, `poll`, `wait` and `communicate` behave as for any child); `run` is `subprocess.run`.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.job.startup import StartupPlan

REPO = Path(__file__).resolve().parents[2]
# Variables read at run time only (by the runner, pytest, Rich, `keras.distribution.initialize`, the tests'
# own model code), never by TensorFlow, Keras or JAX while they load.
_INERT_PREFIXES = ("RUNNER_", "PYTEST_", "KERAS_DISTRIBUTION_")
_INERT = {"PWD", "OLDPWD", "COLUMNS", "LINES", "_", "MARKS", "HOLD_FILE", "HOLD_AT_STEP"}


def _loading_env(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in _INERT and not k.startswith(_INERT_PREFIXES)}


# --- the server ----------------------------------------------------------------------------------------------


def _prime(plan: dict[str, Any]) -> dict[str, str]:
    """Loads TensorFlow as the runner's `startup.preload` does for this plan (`StartupPlan.to_dict`). Returns
    the variables the import set (TF2_BEHAVIOR, ...), which a fresh process has from then on. JAX is imported,
    never asked for its devices: that would start its runtime's threads."""
    import logging

    from runner.job import startup

    chosen = startup.StartupPlan(plan["command"], True, plan["backend"], plan["reason"], plan["environment"],
                                 tuple(plan["skipped_imports"]), plan["debug"], plan["storage_timeout_s"])
    startup.preload(chosen)
    loaded = dict(os.environ)
    import keras  # noqa: F401  (TensorFlow imports it lazily)
    set_by_import = {k: v for k, v in os.environ.items() if loaded.get(k) != v}
    for name in [n for n in sys.modules if n == "runner" or n.startswith("runner.")]:
        del sys.modules[name]
    manager = logging.root.manager
    for name in [n for n in manager.loggerDict if n == "runner" or n.startswith("runner.")]:
        del manager.loggerDict[name]
    logging.root.handlers.clear()
    return set_by_import


def _child(request: dict, loaded_as: str, set_by_import: dict[str, str]) -> None:
    """Runs in the forked child: becomes `python -m runner ARGS` and never returns (SystemExit ends it)."""
    # As Python leaves them at start-up: SIGPIPE and SIGXFSZ ignored (a write to a closed pipe raises), SIGINT
    # raises KeyboardInterrupt, the rest default.
    for sig in (signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):
        signal.signal(sig, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    os.environ.update(set_by_import)
    os.environ["RUNNER_TENSORFLOW_PRELOADED"] = loaded_as  # the runner's start-up checks its plan against it
    sys.argv = [str(REPO / "runner" / "__main__.py"), *request["args"]]
    sys.path[0] = os.getcwd()
    runpy.run_module("runner", run_name="__main__", alter_sys=True)
    raise SystemExit(0)


def serve(path: str, plan: str) -> None:
    set_by_import = _prime(json.loads(plan))
    loaded_as = json.dumps(json.loads(plan)["loaded_as"])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    parent = os.getppid()
    # Asleep until a request or a child's end (SIGCHLD through a wake-up pipe), or a second has passed (to see
    # whether the suite's worker is gone): an idle zygote costs no CPU.
    woken, wake = os.pipe()
    os.set_blocking(wake, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda *_: None)
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
    while True:
        ready, _, _ = select.select([listener, woken], [], [], 1.0)
        if woken in ready:
            os.read(woken, 4096)
        if listener in ready:
            conn, _ = listener.accept()
            conn.settimeout(10)
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            request = json.loads(message)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                for fd in (woken, wake):
                    os.close(fd)
                listener.close()
                for other in waiting.values():
                    other.close()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                    os.close(fd)
                conn.close()
                _child(request, loaded_as, set_by_import)
            for fd in fds:
                os.close(fd)
            conn.sendall(json.dumps({"pid": pid}).encode())
            waiting[pid] = conn
        while waiting:
            pid, status, usage = os.wait4(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid)
            try:
                conn.sendall(json.dumps({"status": status, "cpu_s": usage.ru_utime + usage.ru_stime}).encode())
            except OSError:
                pass
            conn.close()
        if os.getppid() != parent:  # the suite's worker is gone
            stop()


# --- which commands it can run -----------------------------------------------------------------------------


def plan_for(args: list[str], cwd: Path, env: Mapping[str, str]) -> StartupPlan | None:
    """The runner's own start-up plan for this command (`runner.cli.startup_plan`), or None for a command to
    start fresh: one that loads no TensorFlow, asks for `--debug`, or computes with JAX on anything but the CPU
    platform (what a zygote would load there is not what the suite checks). A command the runner stops before
    TensorFlow loads (a bad spec) gets the default plan: its child stops as a fresh process would."""
    from runner import RunnerError
    from runner.cli import startup_plan
    from runner.job import startup

    try:
        plan = startup_plan(args, env, cwd)
    except RunnerError:
        plan = startup.plan("prepare", None, False, env)
    if not plan.loads_tensorflow or plan.debug:
        return None
    if plan.backend == "jax" and plan.environment.get("JAX_PLATFORMS") != "cpu":
        return None
    return plan


# --- the client ----------------------------------------------------------------------------------------------


class _Zygote:
    def __init__(self, plan: StartupPlan, env: Mapping[str, str]) -> None:
        self.folder = tempfile.mkdtemp(prefix="runner-zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.log = open(os.path.join(self.folder, "stderr.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.zygote", self.path,
             json.dumps({**plan.to_dict(), "loaded_as": plan.loaded_as()})], cwd=REPO, env=env,
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
# The zygotes a worker keeps, the least recently used stopped first. Each holds about 220 MB of its own (TensorFlow
# loaded; JAX adds 130 MB). Six were too few: a run of tests with one-off environments (a TPU's variables, a
# KERAS_HOME, a PYTHONPATH of their own) pushed out the default and gs:// ones, and each came back as 9 CPU-s.
_MOST = 12


def _zygote_for(plan: StartupPlan, env: Mapping[str, str]) -> _Zygote | None:
    """The zygote of this plan and environment: the plan's own variables (and KERAS_BACKEND, which the plan's
    backend says) are the plan's, whatever the environment held before."""
    base = {k: v for k, v in _loading_env(env).items() if k not in plan.environment and k != "KERAS_BACKEND"}
    key = (json.dumps(plan.loaded_as(), sort_keys=True), *sorted(base.items()))
    with _lock:
        zygote = _zygotes.pop(key, None)
        if zygote is None or (zygote.ready and zygote.proc.poll() is not None):
            zygote = _Zygote(plan, env)
            _trace("zygote", backend=plan.backend, keys=sorted(k for k, v in key[1:] if os.environ.get(k) != v)
                   + sorted(k for k, v in plan.environment.items() if os.environ.get(k) != v))
        _zygotes[key] = zygote  # the newest last
        while len(_zygotes) > _MOST:
            _zygotes.pop(next(iter(_zygotes))).stop()
        return zygote if zygote.wait_ready() else None


def _trace(event: str, **fields: object) -> None:
    """A line per zygote started, per command run and per forked child ended, with the test it was for, in
    RUNNER_TEST_ZYGOTE_LOG when set (to see what the suite's commands cost)."""
    path = os.environ.get("RUNNER_TEST_ZYGOTE_LOG")
    if path:
        test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]
        with open(path, "a") as log:
            log.write(json.dumps({"event": event, "at": time.time(), "pid": os.getpid(), "test": test, **fields})
                      + "\n")


@atexit.register
def _stop_all() -> None:
    for zygote in _zygotes.values():
        zygote.stop()


class Forked(subprocess.Popen):
    """subprocess.Popen of `python -m runner ARGS` whose child a zygote forks and reaps: the child's standard
    streams are the ones Popen made (passed to the zygote over its socket, /dev/null for an inherited stdin)
    and its exit status comes back on the same socket. If the zygote is gone, the child starts fresh.

    Why private methods: subprocess.Popen has no public way to start its child otherwise or to learn its end
    otherwise. In CPython 3.11's Lib/subprocess.py (the suite's Python), the POSIX `_execute_child` forks through
    `_posixsubprocess.fork_exec` (it is what `preexec_fn`, `pass_fds` and the rest feed), and `wait`, `poll`,
    `send_signal` and `communicate` learn the end from `os.waitpid(self.pid, ...)` in `_try_wait` and
    `_internal_poll` (the latter binds `_waitpid` as a default argument, so it must be overridden on its own).
    A zygote's child is not this process's child: `waitpid` fails with ECHILD, which both methods turn into
    exit status 0 ("This child is dead, we can't get the status"), a failed command seen as a success. The
    public way round, a real child that relays to the zygote's, would give the test the relay's PID (the signal
    tests signal and read /proc of the runner's own process) and cost a Python start per command. These three
    methods are the whole of it; what they cannot give (`preexec_fn`, `pass_fds`, a new session or process
    group, another executable) starts a fresh child through Popen's own code."""

    def __init__(self, zygote: _Zygote, args: list[str], **kwargs: Any) -> None:
        self._zygote: _Zygote | None = zygote
        self._conn: socket.socket | None = None
        self._status: int | None = None
        self.cpu_s: float | None = None  # the child's CPU seconds, once it has ended (from the zygote's wait4)
        super().__init__([sys.executable, "-m", "runner", *args], **kwargs)

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,  # noqa: ANN001
                       creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, *rest):
        restore_signals, gid, gids, uid, umask, start_new_session, process_group = rest
        if preexec_fn or pass_fds or start_new_session or process_group not in (None, -1) or executable:
            self._zygote = None  # what a fork from the zygote cannot give: a fresh process
        if self._zygote is None:
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, *rest)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        null = os.open(os.devnull, os.O_RDONLY)
        request = {"args": list(args[3:]), "env": dict(os.environ if env is None else env),
                   "cwd": os.fspath(cwd or os.getcwd())}
        streams = [null if p2cread == -1 else p2cread, 1 if c2pwrite == -1 else c2pwrite,
                   2 if errwrite == -1 else errwrite]
        try:
            conn.connect(self._zygote.path)
            socket.send_fds(conn, [json.dumps(request).encode()], streams)
            self.pid = json.loads(conn.recv(1 << 16))["pid"]
        except OSError:  # the zygote is gone (its socket with it): this command starts fresh
            conn.close()
            self._zygote.proc.kill()
            self._zygote = None
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread,
                                          errwrite, *rest)
        finally:
            os.close(null)
        self._conn = conn
        self._child_created = True
        self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)

    def _try_wait(self, wait_flags: int) -> tuple[int, int]:
        if self._zygote is None:
            return super()._try_wait(wait_flags)
        if self._status is None:
            self._conn.setblocking(not wait_flags & os.WNOHANG)
            try:
                message = self._conn.recv(1 << 16)
            except BlockingIOError:
                return 0, 0
            # No message: the zygote ended, having killed the children it waited for.
            answer = json.loads(message) if message else {"status": signal.SIGKILL}
            self._status, self.cpu_s = answer["status"], answer.get("cpu_s")
            self._conn.close()
            _trace("forked", command=str(self.args[3]), cpu_s=self.cpu_s)
        return self.pid, self._status

    def _internal_poll(self, _deadstate: int | None = None, **_: Any) -> int | None:
        if self._zygote is None:
            return super()._internal_poll(_deadstate)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    pid, status = self._try_wait(os.WNOHANG)
                    if pid == self.pid:
                        self._handle_exitstatus(status)
            finally:
                self._waitpid_lock.release()
        return self.returncode


def popen(args: list[str], *, env: Mapping[str, str], cwd: Path, plan: StartupPlan | str | None = "auto",
          **kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen([python, -m, runner, *args], env=env, cwd=cwd, **kwargs)`, its child forked by the
    zygote of `plan`: "auto" is the runner's own plan for the command (`plan_for`; a fresh process under
    RUNNER_TEST_FRESH=1), None a fresh process as a user starts it."""
    args = [str(arg) for arg in args]
    if plan == "auto":
        plan = None if os.environ.get("RUNNER_TEST_FRESH") == "1" else plan_for(args, Path(cwd), env)
    zygote = _zygote_for(plan, env) if plan else None
    if zygote is None:
        return subprocess.Popen([sys.executable, "-m", "runner", *args], env=env, cwd=cwd, **kwargs)
    return Forked(zygote, args, env=env, cwd=cwd, **kwargs)


def run(args: list[str], *, env: Mapping[str, str], cwd: Path, timeout: float,
        plan: StartupPlan | str | None = "auto") -> subprocess.CompletedProcess:
    """`subprocess.run([python, -m, runner, *args], capture_output=True, text=True, timeout=timeout)`, the child
    as `popen` starts it. On a timeout the child is killed and TimeoutExpired raised with what it wrote."""
    began = time.monotonic()
    with popen(args, env=env, cwd=cwd, plan=plan, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
               text=True) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            raise subprocess.TimeoutExpired(process.args, timeout, out, err) from None
    _trace("run", command=str(args[0]), forked=isinstance(process, Forked),
           seconds=round(time.monotonic() - began, 2), cpu_s=getattr(process, "cpu_s", None))
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def fresh(args: list[str], *, env: Mapping[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`python -m runner ARGS` started afresh, as a user starts it."""
    return run(args, env=env, cwd=cwd, timeout=timeout, plan=None)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
