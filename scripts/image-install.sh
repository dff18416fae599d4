#!/bin/sh
# Python package installs inside the image build (see Dockerfile); not meant for a workstation.
#
#   image-install.sh list GROUP               print pyproject.toml's requirements: GROUP is `runtime` (the
#                                            project's dependencies) or an extra such as `test`
#   image-install.sh pinned FILE [REQ...]     install FILE's requirements (and REQ...) at the versions
#                                            requirements.lock pins
#   image-install.sh nodeps REQ...            install without dependencies: tf-keras (it requires the
#                                            `tensorflow` wheel, which would pull a second TensorFlow) and
#                                            requirements-data.txt's offline-data packages (old pins)
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
    pip install --constraint requirements.lock --requirement "$file" "$@"
    ;;
  nodeps)
    pip install --no-deps "$@"
    ;;
  *)
    echo "image-install.sh: unknown command '$what' (list, pinned or nodeps)" >&2
    exit 2
    ;;
esac
