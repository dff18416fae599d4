#!/bin/sh
# Python package installs inside the image build (see Dockerfile); not meant for a workstation.
#
#   image-install.sh list GROUP               print pyproject.toml's requirements: GROUP is `runtime` (the
#                                            project's dependencies) or an extra such as `test`
#   image-install.sh pinned FILE [REQ...]     install FILE's requirements (and REQ...) at the versions
#                                            requirements.lock pins ($LOCK: another lock, e.g. the TPU
#                                            image's requirements-tpu.lock)
#   image-install.sh nodeps REQ...            install without dependencies: requirements-data.txt's
#                                            offline-data packages (they pin old numpy and pandas)
#   image-install.sh check-tpu                with the runner installed, in a build (no TPU): `runner doctor`
#                                            finds jax, jaxlib and libtpu agreeing with jax's `tpu` extra and
#                                            libtpu where JAX looks for it, and says there is no TPU, with the cause
#                                            and the fix and no traceback; TensorFlow imports without libtpu
#
# A CA certificate handed over as the BuildKit secret `pip_cert` is trusted by pip (for a TLS-inspecting
# proxy); without it pip uses its own bundle.
set -eu
if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi

what="${1:-}"
[ $# -gt 0 ] && shift
case "$what" in
  list)
    python3 - "$1" <<'EOF'
import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
group = sys.argv[1]
print("\n".join(project["dependencies"] if group == "runtime" else project["optional-dependencies"][group]))
EOF
    ;;
  pinned)
    file="$1"
    shift
    # The test stage has requirements-test.lock too: the test suite's own pins, beside the runtime lock.
    tests=""
    if [ -f requirements-test.lock ]; then tests="--constraint requirements-test.lock"; fi
    # shellcheck disable=SC2086 # $tests is empty or two words
    pip install --constraint "${LOCK:-requirements.lock}" $tests --requirement "$file" "$@"
    ;;
  nodeps)
    pip install --no-deps "$@"
    ;;
  check-tpu)
    # Bounded twice: the doctor bounds each check, `timeout` the whole (a libtpu that hangs must fail the build).
    out="$(mktemp)" err="$(mktemp)" status=0
    timeout 300 runner doctor --json --timeout 120 >"$out" 2>"$err" || status=$?
    python3 - "$out" "$err" "$status" <<'EOF'
import json, os, sys
out, err, status = open(sys.argv[1]).read(), open(sys.argv[2]).read(), int(sys.argv[3])
if status == 124:
    raise SystemExit("image-install.sh: runner doctor did not finish within 300 s")
if "Traceback" in out + err or not out.strip():
    raise SystemExit(f"image-install.sh: runner doctor (exit {status}) printed a traceback or no report:\n"
                     f"{(out + err)[-3000:]}")
checks = {check["name"]: check for check in json.loads(out.strip().splitlines()[-1])["checks"]}
versions, jax = checks["versions"], checks.get("jax", {})
for check in (versions, jax):
    print(f"{check.get('name')}: {check.get('status')}: {check.get('evidence')} -> {check.get('action') or '-'}")
seen, problems = jax.get("data", {}), []
if versions["status"] != "ok":
    problems.append(f"versions is {versions['status']}, not ok")
if jax.get("status") != "warn":
    problems.append(f"jax is {jax.get('status')}: a build has no TPU, so it should warn")
if not seen.get("libtpu_path") or seen.get("jax_library_path") != seen["libtpu_path"]:
    problems.append(f"JAX looks for libtpu at {seen.get('jax_library_path')}, the package has {seen.get('libtpu_path')}")
elif not os.path.isfile(seen["libtpu_path"]):
    problems.append(f"{seen['libtpu_path']} does not exist")
if not jax.get("evidence", "").startswith("no TPU here") or "TPU VM" not in jax.get("action", ""):
    problems.append("the jax check does not say that there is no TPU here and what to do")
if problems:
    raise SystemExit("image-install.sh: the TPU image's check failed: " + "; ".join(problems))
EOF
    rm -f "$out" "$err"
    # tf.data only: the CPU wheel must not load libtpu (the TPU is JAX's) nor see any accelerator.
    TF_CPP_MIN_LOG_LEVEL=2 python3 -c "
import tensorflow as tf
devices = [d.device_type for d in tf.config.list_physical_devices()]
loaded = 'libtpu' in open('/proc/self/maps').read()
if loaded or devices != ['CPU']:
    raise SystemExit(f'image-install.sh: TensorFlow sees {devices}, libtpu loaded: {loaded}')
print('tensorflow:', tf.__version__, devices, 'libtpu not loaded')"
    ;;
  *)
    echo "image-install.sh: unknown command '$what' (list, pinned, nodeps or check-tpu)" >&2
    exit 2
    ;;
esac
