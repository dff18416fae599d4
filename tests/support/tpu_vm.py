"""A simulated TPU VM for the startup script: a PATH holding only the tools a TPU VM image has, plus stand-ins
for `docker` and `gcloud` that record every call.

    vm_env(folder, metadata_host=..., gcs_dir=... | gcs_env=..., job="exit:0", ...)  -> the environment
    run_startup_script(script, env)                                                   -> runs it like a boot

The stand-ins (this file, run as `python tpu_vm.py docker|gcloud ARGS`):
  docker pull | login                  recorded; FAKE_PULL=fail makes every pull fail, =hang never answer;
                                       FAKE_PULL_DELAY_S: a pull that takes that long (a slow worker)
  docker run ... IMAGE doctor ...      prints a doctor line, exits FAKE_DOCTOR_EXIT (0); FAKE_DOCTOR=hang: never
  docker run ... IMAGE run /job/X      the job, by the next entry of FAKE_JOB (comma separated, one per
                                       job run, the last repeats; the count is kept in FAKE_STATE):
                                         exit:N      prints two lines and exits N (0 also writes a succeeded
                                                     summary.json for the spec's epochs into the run folder)
                                         sleep:S:N   the same after S seconds; SIGTERM meanwhile: exit 75
                                                     (FAKE_STATE/job_listening: the handler is in place)
                                         hold:N      the same once the test calls `release(env)` (at most
                                                     300 s); SIGTERM meanwhile: exit 75
                                         hang        a job that never ends and ignores SIGTERM (300 s at most):
                                                     only KILL stops it
                                         stall       a job whose guard sees no progress: after the
                                                     `--set train.stall_timeout=S` it was given, writes the
                                                     run folder's stalled.json (no summary) and exits 124
                                         limit       the same at `--set train.max_duration=S`: "time_limit", 124
                                         real        the real `python -m runner run` on this machine's CPU
                                                     (`--set accelerator.kind=cpu`: there is no TPU here), with
                                                     the limits' `--set`s it was given
                                         jax         the same as the TPU image runs it: Keras on JAX
                                                     (`--set accelerator.backend=jax`). On a slice (the metadata
                                                     server lists several workers) each worker's job is one JAX
                                                     process of one job, found as JAX finds a slice's: its number
                                                     is agent-worker-number, the count the workers listed, the
                                                     coordinator worker 0, here 127.0.0.1:FAKE_JAX_PORT (through
                                                     Keras's KERAS_DISTRIBUTION_* variables)
                                       A real job runs as a container does: in a process group of its own (the
                                       VM's shutdown signals the startup script's group, not the container's),
                                       which the stand-in stops as dockerd stops a container: SIGTERM, then
                                       SIGKILL once the container's stop timeout has passed (`--stop-timeout`,
                                       else FAKE_DOCKER_STOP_TIMEOUT_S, standing for dockerd's default of 10 s);
                                       a container killed so exits 137
  docker rm -f NAME                    recorded; kills a real job's container that outlived its `docker run`
  --log-driver=gcplogs                 with FAKE_LOGGING (an endpoint) each output line is also written to
                                       Cloud Logging's entries:write as docker's gcplogs driver writes it
                                       (log gcplogs-docker-driver, jsonPayload.container.name "/NAME");
                                       without it, docker's answer when Cloud Logging is unreachable: exit 125
  gcloud storage cp | ls | cat         against FAKE_GCS_DIR (a local folder standing for gs://) or, without
                                       it, the GCS emulator (STORAGE_EMULATOR_HOST) through its JSON API
  gcloud auth configure-docker | print-access-token    recorded (a fake token)
  gcloud (anything else)               the real gcloud (FAKE_REAL_GCLOUD) with the caller's endpoint overrides:
                                       the queued-resource delete reaches the TPU API fake as gcloud sends it
"""

from __future__ import annotations

# Imported by the stand-ins, each a process of its own run many times per boot: only what starts fast.
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What the startup script calls, found on this machine and linked into the VM's PATH. A tool not listed
# here is missing on the simulated VM (docker-credential-gcloud, unless a test adds it).
_TOOLS = ("bash", "sh", "curl", "date", "seq", "sleep", "tee", "mkdir", "tr", "grep", "base64", "cat", "rm", "env",
          "timeout")


def vm_bin(folder: Path, credential_helper: bool = True) -> Path:
    bin_dir = folder / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in _TOOLS:
        found = shutil.which(tool)
        if found and not (bin_dir / tool).exists():
            (bin_dir / tool).symlink_to(found)
    if not (bin_dir / "python3").exists():
        (bin_dir / "python3").symlink_to(sys.executable)
    for name in ("docker", "gcloud"):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(__file__)} {name} \"$@\"\n")
        shim.chmod(0o755)
    helper = bin_dir / "docker-credential-gcloud"
    if credential_helper:
        helper.write_text("#!/bin/sh\necho '{\"Secret\": \"fake\"}'\n")
        helper.chmod(0o755)
    else:
        helper.unlink(missing_ok=True)
    return bin_dir


def vm_env(folder: Path, *, metadata_host: str, tpu_endpoint: str, job: str = "exit:0", gcs_dir: Path | None = None,
           gcs_env: dict[str, str] | None = None, logging_endpoint: str | None = None, credential_helper: bool = True,
           **extra: str) -> dict[str, str]:
    """The environment of a simulated VM whose API calls reach the given fakes."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": str(vm_bin(folder, credential_helper)),
        "HOME": str(folder / "home"),
        "GCE_METADATA_HOST": metadata_host,
        "FAKE_CALLS": str(folder / "calls.txt"),
        "FAKE_STATE": str(folder / "state"),
        "RUNNER_WORKDIR": str(folder / "work"),  # the VM's disk (/var/lib/runner/... on a real one)
        "FAKE_JOB": job,
        "FAKE_REAL_GCLOUD": shutil.which("gcloud") or "gcloud",
        "FAKE_REAL_PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CLOUDSDK_API_ENDPOINT_OVERRIDES_TPU": f"{tpu_endpoint}/",
        "CLOUDSDK_AUTH_ACCESS_TOKEN": "fake-vm-token",
        "CLOUDSDK_CORE_CHECK_GCE_METADATA": "false",
        "CLOUDSDK_CONFIG": str(folder / "gcloud"),
        "CLOUDSDK_CORE_DISABLE_PROMPTS": "1",
        "RUNNER_METADATA_RETRY_S": "0.2",
        "RUNNER_PULL_RETRY_S": "0",
        "PYTHONUNBUFFERED": "1",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    if gcs_dir is not None:
        env["FAKE_GCS_DIR"] = str(gcs_dir)
    env.update(gcs_env or {})
    if logging_endpoint:
        env["FAKE_LOGGING"] = logging_endpoint
    env.update(extra)
    return env


def run_startup_script(script: str, env: dict[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """Runs a startup script as a TPU VM runs it at boot (bash, as root would, in its own session)."""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout_s, env=env,
                          start_new_session=True)


def release(env: dict[str, str]) -> None:
    """Lets the jobs of `hold:N` end (the one running, and any later one)."""
    state = Path(env["FAKE_STATE"])
    state.mkdir(parents=True, exist_ok=True)
    (state / "released").touch()


def calls(env: dict[str, str]) -> list[str]:
    path = Path(env["FAKE_CALLS"])
    return path.read_text().splitlines() if path.exists() else []


# --- gs:// for the stand-ins ----------------------------------------------------------------------


def _split(url: str) -> tuple[str, str]:
    bucket, _, name = url[len("gs://"):].partition("/")
    return bucket, name


def _http(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    """One request to a server on this machine (the GCS emulator, the Cloud Logging fake)."""
    import http.client
    import urllib.parse

    where = urllib.parse.urlsplit(url)
    connection = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
    try:
        headers = {"Content-Type": "application/octet-stream" if body is not None else "text/plain"}
        connection.request(method, path, body=body, headers=headers)
        answer = connection.getresponse()
        return answer.status, answer.read()
    finally:
        connection.close()


def gcs_read(url: str) -> bytes | None:
    bucket, name = _split(url)
    if os.environ.get("FAKE_GCS_DIR"):
        path = Path(os.environ["FAKE_GCS_DIR"]) / bucket / name
        return path.read_bytes() if path.is_file() else None
    from urllib.parse import quote

    status, data = _http(os.environ["STORAGE_EMULATOR_HOST"], "GET",
                         f"/storage/v1/b/{quote(bucket, safe='')}/o/{quote(name, safe='')}?alt=media")
    if status == 404:
        return None
    if status != 200:
        raise SystemExit(f"fake gcloud: GET gs://{bucket}/{name}: HTTP {status} {data[:200]!r}")
    return data


def gcs_write(url: str, data: bytes) -> None:
    bucket, name = _split(url)
    if os.environ.get("FAKE_GCS_DIR"):
        path = Path(os.environ["FAKE_GCS_DIR"]) / bucket / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return
    from urllib.parse import quote

    status, answer = _http(
        os.environ["STORAGE_EMULATOR_HOST"],
        "POST",
        f"/upload/storage/v1/b/{quote(bucket, safe='')}/o?uploadType=media&name={quote(name, safe='')}",
        data,
    )
    if status != 200:
        raise SystemExit(f"fake gcloud: upload to gs://{bucket}/{name}: HTTP {status} {answer[:200]!r}")


# --- the stand-ins ---------------------------------------------------------------------------------


def _record(argv: list[str]) -> None:
    with open(os.environ["FAKE_CALLS"], "a") as file:
        file.write(" ".join(argv) + "\n")


def fake_gcloud(args: list[str]) -> int:
    _record(["gcloud", *args])
    words = [a for a in args if not a.startswith("--")]
    if words[:2] == ["storage", "cp"]:
        gcs_write(words[3], Path(words[2]).read_bytes())
        return 0
    if words[:2] == ["storage", "ls"]:
        return 0 if gcs_read(words[2]) is not None else 1
    if words[:2] == ["storage", "cat"]:
        data = gcs_read(words[2])
        if data is None:
            print(
                f"ERROR: (gcloud.storage.cat) The following URLs matched no objects or files:\n-{words[2]}",
                file=sys.stderr,
            )
            return 1
        sys.stdout.buffer.write(data)
        return 0
    if words[:2] == ["auth", "configure-docker"]:
        return 0
    if words[:2] == ["auth", "print-access-token"]:
        print("fake-vm-token")
        return 0
    env = {**os.environ, "PATH": os.environ["FAKE_REAL_PATH"]}
    return subprocess.run([os.environ["FAKE_REAL_GCLOUD"], *args], env=env).returncode


_VALUED = {"--name", "--log-opt", "--label", "-e", "-v", "--user", "--entrypoint", "--stop-timeout"}
_FLAGS = {"--rm", "--privileged", "--net=host", "-i", "-t", "-d"}


def _parse_run(args: list[str]) -> tuple[dict[str, list[str]], str, list[str]]:
    """docker run's options, its image and the command after it; an option docker would not take fails."""
    options: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg in _VALUED:
            options.setdefault(arg, []).append(args[i + 1])
            i += 2
        elif arg.startswith("--log-driver="):
            options["--log-driver"] = [arg.split("=", 1)[1]]
            i += 1
        elif arg in _FLAGS:
            options.setdefault(arg, [])
            i += 1
        elif arg.startswith("-"):
            raise SystemExit(f"fake docker: unknown docker run option {arg!r}")
        else:
            return options, arg, args[i + 1 :]
    raise SystemExit("fake docker: docker run without an image")


class CloudLogging:
    """What docker's gcplogs driver does with each line: one entry in projects/P/logs/gcplogs-docker-driver."""

    def __init__(self, endpoint: str, container: str):
        self.endpoint, self.container = endpoint.rstrip("/"), container
        self.project = os.environ.get("RUNNER_FAKE_PROJECT", "runner-test")

    def write(self, line: str) -> None:
        entry = {
            "jsonPayload": {
                "message": line.rstrip("\n"),
                "container": {"name": f"/{self.container}"},
                "instance": {"name": os.environ.get("FAKE_NODE", ""), "zone": "fake"},
            }
        }
        doc = {
            "logName": f"projects/{self.project}/logs/gcplogs-docker-driver",
            "resource": {"type": "gce_instance"},
            "entries": [entry],
        }
        status, answer = _http(self.endpoint, "POST", "/v2/entries:write", json.dumps(doc).encode())
        if status != 200:
            raise SystemExit(f"fake docker: Cloud Logging entries:write: HTTP {status} {answer[:200]!r}")


def _next_job() -> str:
    plan = [p.strip() for p in os.environ.get("FAKE_JOB", "exit:0").split(",") if p.strip()]
    state = Path(os.environ["FAKE_STATE"])
    state.mkdir(parents=True, exist_ok=True)
    counter = state / "job_runs"
    runs = int(counter.read_text()) if counter.exists() else 0
    counter.write_text(str(runs + 1))
    return plan[min(runs, len(plan) - 1)]


def _run_dir(spec_path: Path) -> str:
    import yaml

    spec = yaml.safe_load(spec_path.read_text())
    return f"{spec['output']['dir'].rstrip('/')}/{spec['name']}"


def _write_summary(spec_path: Path, status: str) -> None:
    """A summary.json in the spec's run folder (succeeded: every epoch done; otherwise none)."""
    import yaml

    spec = yaml.safe_load(spec_path.read_text())
    run_dir = _run_dir(spec_path)
    epochs = int((spec.get("train") or {}).get("epochs", 12))
    summary = {
        "schema_version": 1,
        "status": status,
        "job": spec["name"],
        "train_epochs": epochs,
        "steps_per_epoch": 10,
        "final_step": 10 * epochs if status == "succeeded" else 0,
    }
    gcs_write(f"{run_dir}/summary.json", json.dumps(summary).encode())


def fake_docker(args: list[str]) -> int:
    _record(["docker", *args])
    if not args:
        return 1
    if args[0] == "pull":
        if os.environ.get("FAKE_PULL") == "hang":  # a registry that never answers
            time.sleep(300)
        time.sleep(float(os.environ.get("FAKE_PULL_DELAY_S") or 0))
        return 1 if os.environ.get("FAKE_PULL") == "fail" else 0
    if args[0] == "login":
        sys.stdin.read()
        return 0
    if args[:2] == ["rm", "-f"]:
        _remove_container(args[2])
        return 0
    if args[0] != "run":
        return 0
    options, _image, command = _parse_run(args[1:])
    driver = (options.get("--log-driver") or ["json-file"])[0]
    if driver == "gcplogs" and not os.environ.get("FAKE_LOGGING"):
        print(
            "docker: Error response from daemon: failed to initialize logging driver: unable to connect or "
            "authenticate with Google Cloud Logging: fake",
            file=sys.stderr,
        )
        return 125
    sink = CloudLogging(os.environ["FAKE_LOGGING"], options["--name"][0]) if driver == "gcplogs" else None

    def emit(line: str) -> None:
        sys.stdout.write(line)
        sys.stdout.flush()
        if sink:
            sink.write(line)

    if command[:1] == ["doctor"]:
        if os.environ.get("FAKE_DOCTOR") == "hang":  # a TPU start that never returns
            emit("doctor: starting the TPU (hang)\n")
            time.sleep(300)
        emit('{"doctor": "fake", "ok": true}\n')
        return int(os.environ.get("FAKE_DOCTOR_EXIT", "0"))
    mounts = dict(v.rsplit(":", 2)[:2] if v.count(":") >= 2 else v.split(":", 1) for v in options.get("-v", []))
    job_dir = Path(next(src for src, dst in mounts.items() if dst == "/job"))
    spec_path = job_dir / Path(command[1]).relative_to("/job")
    behaviour = _next_job()
    kind, *values = behaviour.split(":")
    given = dict(command[i + 1].split("=", 1) for i in range(len(command) - 1) if command[i] == "--set")
    if kind in ("real", "jax"):
        return _run_real(spec_path, options, emit, given, jax=kind == "jax")
    if kind in ("stall", "limit"):
        key, status = ("train.stall_timeout", "stalled") if kind == "stall" else ("train.max_duration", "time_limit")
        emit(f"epoch 1/2: training ({behaviour}, {key}={given[key]})\n")
        time.sleep(float(given[key]))
        if kind == "stall":  # the runner's stall guard writes no summary, only its mark (runner/rundir/stalled.py)
            gcs_write(f"{_run_dir(spec_path)}/stalled.json", json.dumps({"message": "stalled"}).encode())
        else:
            _write_summary(spec_path, status)
        emit(f'{{"status": "{status}", "exit": 124}}\n')
        return 124
    if kind == "hang":
        signal.signal(signal.SIGTERM, lambda *_: emit("SIGTERM ignored: still running\n"))
        emit("epoch 1/2: training (hang)\n")
        time.sleep(300)
        return 0
    code = int(values[-1])
    emit(f"epoch 1/2: training ({behaviour})\n")
    if kind in ("sleep", "hold"):
        signal.signal(signal.SIGTERM, lambda *_: (emit("preemption notice: saved, exit 75\n"), os._exit(75)))
        (Path(os.environ["FAKE_STATE"]) / "job_listening").touch()  # a SIGTERM from now on is the notice
    if kind == "sleep":
        time.sleep(float(values[0]))
    if kind == "hold":
        released, deadline = Path(os.environ["FAKE_STATE"]) / "released", time.monotonic() + 300
        while not released.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    if code == 0:
        _write_summary(spec_path, "succeeded")
    emit(f'{{"status": "{"succeeded" if code == 0 else "failed"}", "exit": {code}}}\n')
    return code


def _run_real(spec_path: Path, options: dict[str, list[str]], emit, given: dict[str, str], jax: bool) -> int:
    env = dict(os.environ)
    for pair in options.get("-e", []):
        key, _, value = pair.partition("=")
        env[key] = value
    env.pop("TPU_NAME", None)  # there is no TPU here: the job runs on this machine's CPU
    env["PATH"] = os.environ["FAKE_REAL_PATH"]
    # The job's limits from its command line (`--set train.max_duration=S ...`), as the image's runner gets them.
    sets = [x for key, value in given.items() for x in ("--set", f"{key}={value}")]
    if jax:
        sets += ["--set", "accelerator.backend=jax"]
        env.update(_slice_processes())
    child = subprocess.Popen(
        [sys.executable, "-m", "runner", "run", str(spec_path), "--set", "accelerator.kind=cpu", *sets],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=REPO,
        process_group=0,  # the container's processes: not in the startup script's process group
    )
    name = (options.get("--name") or ["container"])[0]
    containers = Path(os.environ["FAKE_STATE"]) / "containers"
    containers.mkdir(parents=True, exist_ok=True)
    (containers / name).write_text(str(child.pid))
    stop_timeout_s = float((options.get("--stop-timeout") or [os.environ.get("FAKE_DOCKER_STOP_TIMEOUT_S", "10")])[0])

    def stop(*_) -> None:  # what dockerd does to the container on `docker stop` or its own shutdown
        emit(f"fake docker: stopping container {name}: SIGTERM, SIGKILL after {stop_timeout_s:g} s\n")
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGTERM)

        def kill() -> None:
            if child.poll() is None:
                emit(f"fake docker: container {name} still running {stop_timeout_s:g} s after SIGTERM: SIGKILL\n")
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)

        timer = threading.Timer(stop_timeout_s, kill)
        timer.daemon = True  # a job that ends in time ends its `docker run` at once
        timer.start()

    signal.signal(signal.SIGTERM, stop)
    reader = threading.Thread(target=lambda: [emit(line) for line in child.stdout], daemon=True)
    reader.start()
    code = child.wait()
    reader.join(timeout=10)
    code = 128 - code if code < 0 else code  # docker's code for a container ended by a signal: 128 + N
    (containers / name).unlink(missing_ok=True)
    (containers / f"{name}.exit").write_text(str(code))  # what `docker inspect` would say of it
    return code


def _slice_processes() -> dict[str, str]:
    """Keras's variables for this worker's JAX process, from what JAX reads on a TPU VM: the metadata server's
    agent-worker-number and worker-network-endpoints (one process per worker listed); none for one worker."""
    import urllib.request

    def attribute(key: str) -> str:
        url = f"http://{os.environ['GCE_METADATA_HOST']}/computeMetadata/v1/instance/attributes/{key}"
        request = urllib.request.Request(url, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.read().decode()

    workers = [w for w in attribute("worker-network-endpoints").split(",") if w.strip()]
    if len(workers) < 2:
        return {}
    return {
        "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{os.environ['FAKE_JAX_PORT']}",
        "KERAS_DISTRIBUTION_NUM_PROCESSES": str(len(workers)),
        "KERAS_DISTRIBUTION_PROCESS_ID": attribute("agent-worker-number"),
    }


def _remove_container(name: str) -> None:
    """`docker rm -f`: a real job's container still running (its `docker run` was killed) is killed."""
    record = Path(os.environ["FAKE_STATE"]) / "containers" / name
    if record.exists():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.killpg(int(record.read_text()), signal.SIGKILL)
        record.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    tool, args = argv[0], argv[1:]
    return fake_docker(args) if tool == "docker" else fake_gcloud(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def dense_model(folder: Path) -> str:
    """A model of one dense layer, as the job's own code in `folder` (`runner submit` sends it with the job): the
    simulated VM's JAX jobs train it, since XLA on these CPUs compiles a CNN for tens of seconds."""
    (folder / "densenet.py").write_text(
        "import keras\n\n\n"
        "def build(params, features, inputs):\n"
        "    x = keras.Input((28, 28, 1))\n"
        "    flat = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))\n"
        "    return keras.Model(x, keras.layers.Dense(10, activation='softmax')(flat))\n"
    )
    return "densenet:build"


def gcs_job_spec(folder: Path) -> Path:
    """The job every simulated TPU VM runs: MNIST from gs://runner-test, its run folder there too."""
    from tests.conftest import write_spec

    return write_spec(folder, {
        "name": "mnist_cnn",
        "data": {"train": "gs://runner-test/data/train-*.tfrecord", "eval": None},
        "train": {"epochs": 2},
        "output": {"dir": "gs://runner-test/runs"},
    })
