"""Code sent with a submitted job (docs/cloud.md, "Sending your code"): `runner submit` packs the spec's code
folder and the user's own packages into an archive named by its sha256, uploads it beside the run folder, and
hands the container RUNNER_CODE; `runner run` fetches it, checks the hash and runs the spec with it.

Real parts only: the CLI as a user runs it, the GCS emulator as the bucket, the Cloud TPU API fake, and the
startup script booted on the simulated TPU VM (tests/support/tpu_vm.py), whose stand-in docker runs the real
`runner run` on this machine's CPU. The user's package exists on the submitting side only (PYTHONPATH of the
`runner submit` process); the VM's job has nothing but the archive."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

from runner.cloud import codepack, engines, jobs, request, submit
from tests.conftest import cli_env, last_json, run_cli, write_spec
from tests.support.cloud import IMAGE, PROJECT, ZONE, cloud_env, invoke
from tests.support.tpu_vm import calls, run_startup_script, vm_env

pytest_plugins = ["tests.support.cloud_fixtures"]

# One dense layer on MNIST: compiles and trains in seconds (the CNN's compile would dominate these tests).
DENSE = (
    "import keras\n\n\n"
    "def build(params, features, inputs):\n"
    "    x = keras.Input((28, 28, 1), name=inputs[0])\n"
    "    flat = keras.layers.Flatten()(keras.layers.Rescaling(1 / 255)(x))\n"
    "    return keras.Model(x, keras.layers.Dense(10, activation='softmax')(flat))\n"
)
SHA = re.compile(r"code: (gs://\S+/code/([0-9a-f]{64})\.tar\.gz) \((\d+) files, ([^;]+);")


def user_project(root: Path) -> tuple[Path, Path]:
    """A code folder (the spec's folder) with a preprocess function among things never to send, and a package of
    the user's own outside it (src/ownlib: on PYTHONPATH, as a package installed from its folder would be)."""
    project, src = root / "project", root / "src"
    (project / "notes").mkdir(parents=True)
    (project / "prep.py").write_text("def identity(batch):\n    return batch\n")
    (project / ".env").write_text("API_TOKEN=do-not-send\n")
    venv = project / ".venv" / "lib" / "python3.11" / "site-packages"
    venv.mkdir(parents=True)
    (project / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / "anything.py").write_text("")
    (project / "env2").mkdir()
    (project / "env2" / "pyvenv.cfg").write_text("home = /usr/bin\n")  # a virtualenv by its marker, any name
    (project / "data").mkdir()
    (project / "data" / "train.csv").write_text("a,b\n1,2\n")
    (project / "data" / "classes.csv").write_text("cat\ndog\n")
    (project / "sa.json").write_text(json.dumps({"type": "service_account", "private_key": "-----BEGIN"}))
    (project / "weights.bin").write_bytes(b"\0" * (codepack.MAX_FILE_BYTES + 1))
    (project / "notes" / "draft.py").write_text("raise SystemExit('never sent')\n")
    (project / "__pycache__").mkdir()
    (project / "__pycache__" / "prep.cpython-311.pyc").write_bytes(b"\0")
    (project / ".runnerignore").write_text("# scratch work\nnotes/\n!data/classes.csv\n")
    package = src / "ownlib"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(DENSE)
    return project, src


def cloud_job(project: Path, bucket: str, **sections) -> Path:
    doc = {
        "name": "sendcode",  # accelerator: auto (a TPU there; the simulated VM's job adds kind=cpu)
        "data": {"train": f"gs://{bucket}/data/train-*.tfrecord", "eval": f"gs://{bucket}/data/test-*.tfrecord",
                 "global_batch_size": 128, "shuffle_buffer": 512, "preprocess": "prep:identity"},
        "model": {"name": "ownlib.nets:build"},
        "train": {"epochs": 1, "allow_chance": True},
        "output": {"dir": f"gs://{bucket}/runs", "tensorboard": False},
        "code": {"packages": ["ownlib"]},
    }
    for section, values in sections.items():
        doc.setdefault(section, {}).update(values)
    return write_spec(project, doc)


def submit_cli(spec: Path, env: dict[str, str], *extra: str):
    return run_cli("submit", spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--project", PROJECT, "--image",
                   IMAGE, *extra, env=env, timeout=180)


def startup_script_sent(tpu_fake) -> str:
    """The startup script of the newest queued resource `runner submit` created in the TPU API fake."""
    creates = [r for r in tpu_fake.requests() if r["method"] == "POST" and r["path"].endswith("/queuedResources")]
    return creates[-1]["body"]["tpu"]["nodeSpec"][0]["node"]["metadata"]["startup-script"]


def sent(stderr: str) -> tuple[str, str]:
    """The archive's URL and sha256 as `runner submit` printed them."""
    found = SHA.search(stderr)
    assert found, stderr
    return found.group(1), found.group(2)


# --- what is sent --------------------------------------------------------------------------------------------


def test_the_dry_run_lists_what_it_sends_and_leaves_out_secrets_virtualenvs_caches_and_data(tmp_path):
    project, src = user_project(tmp_path)
    spec = cloud_job(project, "runner-test")
    env = cli_env(PYTHONPATH=str(src), RUNNER_STATE_DIR=str(tmp_path / "state"),
                  CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
    dry = submit_cli(spec, env, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    url, sha = sent(dry.stderr)
    assert url == f"gs://runner-test/runs/sendcode/code/{sha}.tar.gz"
    listed = re.findall(r"^code:   (\S+) \(", dry.stderr, re.M)
    assert listed == ["folder/data/classes.csv", "folder/job.yaml", "folder/prep.py",
                      "packages/ownlib/__init__.py", "packages/ownlib/nets.py"]
    files, size = SHA.search(dry.stderr).group(3, 4)
    assert int(files) == 5 and size.endswith(" B")
    left_out = next(line for line in dry.stderr.splitlines() if line.startswith("code: left out: "))
    for shown, why in [("folder/.env", "a hidden file"), ("folder/.venv/", "a hidden folder"),
                       ("folder/env2/", "a virtualenv"), ("folder/data/train.csv", "a data file (*.csv)"),
                       ("folder/sa.json", "a private key or credentials"),
                       ("folder/weights.bin", "5,242,881 bytes, over the limit of 5,242,880 (5.0 MB) per file"),
                       ("folder/notes/", ".runnerignore: notes/"), ("folder/__pycache__/", "a cache")]:
        assert f"{shown} ({why}" in left_out, shown
    assert "do-not-send" not in dry.stdout + dry.stderr
    assert request.settings_of(dry.stdout)["RUNNER_CODE"] == f"{url}#sha256={sha}", "what the container is handed"
    assert "--dry-run uploads nothing" in dry.stderr
    again = submit_cli(spec, env, "--dry-run")
    assert sent(again.stderr) == (url, sha), "the same files make the same archive, named the same"
    (project / "prep.py").write_text("def identity(batch):\n    return dict(batch)\n")
    assert sent(submit_cli(spec, env, "--dry-run").stderr)[1] != sha


def test_code_that_is_not_here_stops_the_submission_and_a_package_not_installed_is_left_to_the_image(tmp_path):
    project, _ = user_project(tmp_path)
    spec = cloud_job(project, "runner-test", train={"loss": "losses:focal"})
    env = cli_env(RUNNER_STATE_DIR=str(tmp_path / "state"), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
    refused = submit_cli(spec, env, "--dry-run")  # no PYTHONPATH: ownlib is not installed here
    assert refused.returncode == 2
    assert "train.loss: cannot import 'losses'" in refused.stderr
    assert "`runner submit` sends your code from this machine" in refused.stderr
    assert "model.name" not in refused.stderr, "a listed package that is not here is the image's to have"
    spec = cloud_job(project, "runner-test")
    ok = submit_cli(spec, env, "--dry-run")
    assert ok.returncode == 0, ok.stderr
    assert "code: code.packages 'ownlib' is not installed here, so it is not sent: the image must have it" in ok.stderr
    assert re.findall(r"^code:   (\S+) \(", ok.stderr, re.M) == ["folder/data/classes.csv", "folder/job.yaml",
                                                                   "folder/prep.py"]


@pytest.mark.parametrize("target, flags", [
    ("skypilot", ()), ("gke", ()), ("gke", ("--format", "xpk", "--cluster", "c")), ("vertex", ()),
])
def test_every_engines_dry_run_hands_the_container_the_archive(tmp_path, target, flags):
    project, src = user_project(tmp_path)
    spec = cloud_job(project, "runner-test")
    env = cli_env(PYTHONPATH=str(src), RUNNER_STATE_DIR=str(tmp_path / "state"))
    where = () if target == "skypilot" else ("--project", PROJECT)
    tpu = "v5p-8" if flags else "v5litepod-8"  # a type xpk runs as one host, as the runner does
    dry = run_cli("submit", spec, "--on", target, "--tpu-type", tpu, "--zone", ZONE, "--image", IMAGE,
                  *where, *flags, "--dry-run", env=env, timeout=120)
    assert dry.returncode == 0, dry.stderr
    url, sha = sent(dry.stderr)
    ref = f"{url}#sha256={sha}"
    assert re.findall(r"^code:   (\S+) \(", dry.stderr, re.M)[-1] == "packages/ownlib/nets.py"
    if target == "skypilot":
        env_of_job = yaml.safe_load(dry.stdout)["envs"]
    elif target == "gke" and not flags:
        pod = yaml.safe_load(dry.stdout)["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        env_of_job = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
    elif target == "gke":
        words = shlex.split(dry.stdout)
        env_of_job = dict(words[i + 1].split("=", 1) for i, w in enumerate(words) if w == "--env")
    else:
        job = json.loads(dry.stdout)["customJob"]
        container = job["jobSpec"]["workerPoolSpecs"][0]["containerSpec"]
        env_of_job = {e["name"]: e["value"] for e in container["env"]}
    assert env_of_job["RUNNER_CODE"] == ref
    assert "RUNNER_SPEC_B64" in env_of_job


def test_a_relaunch_hands_the_container_the_same_archive(tmp_path):
    """After a preemption the watcher rebuilds the submission from job.json (or the queued resource): the
    RUNNER_CODE it hands the new VM is the first submission's."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "dense.py").write_text(DENSE)
    spec = cloud_job(project, "runner-test", model={"name": "dense:build"}, code={"packages": []},
                     data={"preprocess": None})
    sub = submit.prepare_submission(spec, tpu_type="v5litepod-8", zone=ZONE, image=IMAGE, project=PROJECT)
    assert sub.code_ref and sub.code_ref == sub.code.ref
    again = jobs.submission_from_job(jobs.job_record(sub), "second")
    assert again.code_ref == sub.code_ref and again.code is None
    assert request.settings_of(request.startup_script(again))["RUNNER_CODE"] == sub.code_ref
    assert engines.container_env(again)["RUNNER_CODE"] == sub.code_ref
    plain = submit.prepare_submission(cloud_job(project, "runner-test", model={"name": "mnist_cnn"},
                                                code={"packages": []}, data={"preprocess": None}),
                                      tpu_type="v5litepod-8", zone=ZONE, image=IMAGE, project=PROJECT)
    assert plain.code_ref is None and "RUNNER_CODE" not in request.settings_of(request.startup_script(plain))
    assert "RUNNER_CODE" not in engines.container_env(plain)


# --- the archive in the bucket, and `runner run` with it ------------------------------------------------------


def local_job(folder: Path, tiny_mnist: Path, runs: Path) -> Path:
    """The job as `runner run` reads it here: its own folder holds no code, its data and run folder are local."""
    folder.mkdir(exist_ok=True)
    return write_spec(folder, {
        "name": "sent",
        "accelerator": {"kind": "cpu", "backend": "tensorflow"},
        "data": {"train": f"{tiny_mnist}/train-*.tfrecord", "eval": f"{tiny_mnist}/test-*.tfrecord",
                 "global_batch_size": 128, "shuffle_buffer": 512},
        "model": {"name": "dense:build"},
        "train": {"epochs": 1, "allow_chance": True},
        "output": {"dir": str(runs), "tensorboard": False},
    })


class Submitted:
    """A job whose model (dense.py in its code folder) `runner submit` sent for real: to the GCS emulator, and
    its queued resource to the TPU API fake."""

    def __init__(self, tpu_fake, gcs, folder: Path):
        self.gcs, self.bucket, self.tpu_fake = gcs, gcs.bucket(), tpu_fake
        self.project = folder / "project"
        self.project.mkdir()
        (self.project / "dense.py").write_text(DENSE)
        self.spec = cloud_job(self.project, self.bucket, model={"name": "dense:build"}, code={"packages": []},
                              data={"preprocess": None})
        self.env = cloud_env(tpu_fake.endpoint, folder, **gcs.env)

    def submit(self):
        """`runner submit` (in this process: it imports no TensorFlow); its output and RUNNER_CODE as sent."""
        done = invoke("submit", self.spec, "--tpu-type", "v5litepod-8", "--zone", ZONE, "--project", PROJECT,
                      "--image", IMAGE, "--no-preflight", env=self.env)
        assert done.returncode == 0, done.stderr
        script = startup_script_sent(self.tpu_fake)
        return done, request.settings_of(script)["RUNNER_CODE"]

    def cancel(self) -> None:
        assert invoke("cancel", "sendcode", "--zone", ZONE, "--project", PROJECT, env=self.env).returncode == 0

    def object_name(self, ref: str) -> str:
        return ref.partition("#")[0].removeprefix(f"gs://{self.bucket}/")


def test_runner_run_trains_a_model_that_lives_only_in_the_uploaded_archive(tpu_fake, gcs, tmp_path, tiny_mnist):
    job = Submitted(tpu_fake, gcs, tmp_path)
    first, ref = job.submit()
    url, sha = sent(first.stderr)
    assert ref == f"{url}#sha256={sha}" and f"code: uploaded {url}" in first.stderr
    generation = gcs.client().bucket(job.bucket).get_blob(job.object_name(ref)).generation
    job.cancel()
    again, same = job.submit()
    assert same == ref and f"code: {url} is already in the bucket: not uploaded again" in again.stderr
    assert gcs.client().bucket(job.bucket).get_blob(job.object_name(ref)).generation == generation

    spec = local_job(tmp_path / "job", tiny_mnist, tmp_path / "runs")
    shutil.rmtree(job.project)  # the model is in the archive only
    result = run_cli("run", spec, env=cli_env(RUNNER_CODE=ref, **gcs.env), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"code: {url} (sha256 checked): 2 files unpacked in " in result.stderr  # dense.py and job.yaml
    summary = last_json(result.stdout)
    assert summary["status"] == "succeeded" and summary["final_step"] > 0
    assert not list(Path(tempfile.gettempdir()).glob(f"runner-code-{sha[:12]}-*")), "each process's copy is removed"

    without = run_cli("evaluate", spec, env=cli_env(**gcs.env), timeout=300)
    assert without.returncode == 2 and "dense" in without.stderr, "the model is in the archive only"
    evaluated = run_cli("evaluate", spec, "--code", ref, env=cli_env(**gcs.env), timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"code: {url} (sha256 checked)" in evaluated.stderr
    assert last_json(evaluated.stdout)["examples"] == 512, "every test record of tiny_mnist"
    np.save(tmp_path / "digits.npy", np.zeros((3, 28, 28, 1), np.uint8))
    predicted = run_cli("predict", spec, "--input", tmp_path / "digits.npy", "--no-check",
                        env=cli_env(RUNNER_CODE=ref, **gcs.env), timeout=300)
    assert predicted.returncode == 0, predicted.stderr[-3000:]
    rows = [json.loads(line) for line in predicted.stdout.splitlines()[-3:]]
    assert [row["index"] for row in rows] == [0, 1, 2] and all(len(row["probabilities"]) == 10 for row in rows)


def test_a_tampered_or_missing_archive_is_refused_naming_it(tpu_fake, gcs, tmp_path, tiny_mnist):
    job = Submitted(tpu_fake, gcs, tmp_path)
    _, ref = job.submit()
    url, sha = ref.split("#sha256=")
    good = gcs.read(job.bucket, job.object_name(ref))
    gcs.write(job.bucket, job.object_name(ref), good + b"tampered")
    spec = local_job(tmp_path / "job", tiny_mnist, tmp_path / "runs")
    env = cli_env(**gcs.env)
    tampered = run_cli("run", spec, "--code", ref, env=env, timeout=120)
    assert tampered.returncode == 2, tampered.stderr
    assert f"the code archive {url} has sha256 " in tampered.stderr and f"not the {sha} " in tampered.stderr
    assert not (tmp_path / "runs").exists(), "refused before the job starts"
    job.cancel()
    again, _ = job.submit()
    assert "replaced an object of that name with other bytes" in again.stderr, "submitting again mends it"
    assert gcs.read(job.bucket, job.object_name(ref)) == good

    missing = ref.replace(sha, "0" * 64)
    gone = run_cli("run", spec, env=cli_env(RUNNER_CODE=missing, **gcs.env), timeout=120)
    assert gone.returncode == 2, gone.stderr
    assert f"the code archive {missing.partition('#')[0]} is not in the bucket (RUNNER_CODE)" in gone.stderr
    malformed = run_cli("run", spec, "--code", url, env=env, timeout=120)
    assert malformed.returncode == 2 and "is not gs://BUCKET/PATH.tar.gz#sha256=HEX" in malformed.stderr


# --- on the simulated TPU VM ------------------------------------------------------------------------------


@pytest.mark.host  # the real gcloud sends the VM's delete
def test_the_startup_script_hands_the_container_the_archive_and_nothing_without_code(tpu_fake, metadata_fake,
                                                                                     tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    (project / "dense.py").write_text(DENSE)
    for name, model in (("with", "dense:build"), ("without", "mnist_cnn")):
        spec = cloud_job(project, "runner-test", model={"name": model}, code={"packages": []},
                         data={"preprocess": None})
        sub = submit.prepare_submission(spec, tpu_type="v5litepod-8", zone=ZONE, image=IMAGE, project=PROJECT)
        vm = vm_env(tmp_path / f"vm-{name}", metadata_host=metadata_fake.host, tpu_endpoint=tpu_fake.endpoint,
                    gcs_dir=tmp_path / f"gcs-{name}", RUNNER_METADATA_TRIES="3", RUNNER_UPLOAD_EVERY_S="1")
        booted = run_startup_script(request.startup_script(sub), vm)
        assert booted.returncode == 0, booted.stderr
        [job] = [c for c in calls(vm) if c.startswith("docker run") and " run /job/spec.yaml" in c]
        doctor = next(c for c in calls(vm) if c.startswith("docker run") and " doctor " in c)
        if sub.code_ref:
            assert f" -e RUNNER_CODE={sub.code_ref} -e RUNNER_WORKER=0 " in job
        else:
            assert "RUNNER_CODE" not in job
        assert "RUNNER_CODE" not in doctor, "the doctor checks the VM, not the user's code"


@pytest.mark.slow
@pytest.mark.host  # the real gcloud sends the VM's delete
def test_the_simulated_tpu_vm_trains_a_model_from_a_package_sent_by_runner_submit(
        tpu_fake, metadata_fake, gcs, tmp_path, tiny_mnist):
    bucket = gcs.bucket()
    gcs.upload_folder(tiny_mnist, bucket, "data")
    project, src = user_project(tmp_path)
    spec = cloud_job(project, bucket, train={"epochs": 1, "steps_per_epoch": 4, "allow_chance": True})
    env = cloud_env(tpu_fake.endpoint, tmp_path, PYTHONPATH=str(src), **gcs.env)
    submitted = submit_cli(spec, env, "--no-preflight")
    assert submitted.returncode == 0, submitted.stderr
    url, sha = sent(submitted.stderr)
    assert f"code: uploaded {url}" in submitted.stderr
    assert url.removeprefix(f"gs://{bucket}/") in gcs.objects(bucket, "runs/sendcode/code/")
    script = startup_script_sent(tpu_fake)
    shutil.rmtree(project)
    shutil.rmtree(src)  # from here on the code exists only in the bucket

    vm = vm_env(tmp_path / "vm", metadata_host=metadata_fake.host, tpu_endpoint=tpu_fake.endpoint, job="real",
                gcs_env=gcs.env, RUNNER_METADATA_TRIES="3", RUNNER_UPLOAD_EVERY_S="1")
    booted = run_startup_script(script, vm, timeout_s=600)
    assert booted.returncode == 0, booted.stderr
    [job] = [c for c in calls(vm) if c.startswith("docker run") and " run /job/spec.yaml" in c]
    assert f"-e RUNNER_CODE={url}#sha256={sha} " in job, "the startup script hands the container the archive"
    summary = json.loads(gcs.read(bucket, "runs/sendcode/summary.json"))
    sub = request.settings_of(script)["RUNNER_SUBMISSION"]
    log = gcs.read(bucket, f"runs/sendcode/logs/{sub}/worker-0.log").decode()
    assert f"code: {url} (sha256 checked): 5 files unpacked" in log, log[-3000:]
    assert summary["status"] == "succeeded" and summary["final_step"] == 4, log[-3000:]
    exit_record = json.loads(gcs.read(bucket, f"runs/sendcode/logs/{sub}/worker-0.exit.json"))
    assert exit_record["exit_code"] == 0 and exit_record["ran"] is True
