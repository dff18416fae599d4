#!/bin/sh
# Python package installs inside the image build (see Dockerfile); not meant for a workstation.
#
#   image-install.sh list GROUP               print pyproject.toml's requirements: GROUP is `runtime` (the
#                                            project's dependencies) or an extra such as `test`
#   image-install.sh pinned FILE [REQ...]     install FILE's requirements (and REQ...) at the versions
#                                            requirements.lock pins ($LOCK: another lock, e.g. the TPU
#                                            image's requirements-tpu.lock)
#   image-install.sh nodeps REQ...            install without dependencies: tf-keras (it requires the
#                                            `tensorflow` wheel, which would pull a second TensorFlow) and
#                                            requirements-data.txt's offline-data packages (old pins)
#   image-install.sh check-libtpu libtpu==V   the installed libtpu is V and its libtpu.so is where
#                                            libtpu.get_library_path() says (what PJRT loads)
#   image-install.sh check-pjrt               with the runner installed: the device API settings
#                                            runner/device/tpu_env.py makes for a v5e are complete, and TensorFlow
#                                            registers libtpu as its PJRT plugin when it imports
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
  check-libtpu)
    python3 - "$1" <<'EOF'
import importlib.metadata, os, sys
want, have = sys.argv[1].split("==", 1)[1], importlib.metadata.version("libtpu")
if have != want:
    raise SystemExit(f"libtpu {have} is installed, but the image pins {want}")
import libtpu
path = libtpu.get_library_path()
if not os.path.isfile(path):
    raise SystemExit(f"libtpu.get_library_path() gives {path}, which does not exist")
print("libtpu", have, path)
EOF
    ;;
  check-pjrt)
    # Off a TPU VM: no metadata server to ask (it would take minutes), and a v5e's generation given instead.
    log="$(mktemp)"
    TPU_SKIP_MDS_QUERY=1 TPU_ACCELERATOR_TYPE=v5litepod-8 TF_CPP_MIN_LOG_LEVEL=0 python3 - >"$log" 2>&1 <<'EOF' || { cat "$log" >&2; exit 1; }
from runner.device.tpu_env import apply_tpu_env
runtime = apply_tpu_env("local")
if runtime.device_api != "pjrt" or runtime.problem:
    raise SystemExit(f"device API for a v5e: {runtime.device_api}, {runtime.problem}")
import tensorflow as tf
print("settings:", runtime.settings)
print("devices:", [d.device_type for d in tf.config.list_physical_devices()])
EOF
    if ! grep -q "PJRT_Api is set for device type tpu" "$log"; then
      cat "$log" >&2
      echo "image-install.sh: TensorFlow did not register libtpu as its PJRT plugin" >&2
      exit 1
    fi
    grep -E "^(settings|devices):|PJRT_Api is set" "$log"
    rm -f "$log"
    ;;
  *)
    echo "image-install.sh: unknown command '$what' (list, pinned, nodeps, check-libtpu or check-pjrt)" >&2
    exit 2
    ;;
esac
