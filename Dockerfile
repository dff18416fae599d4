# The runner image: `runner` is the entrypoint, so `docker run IMAGE run jobs/mnist_cnn.yaml` trains a job.
#
#   DOCKER_BUILDKIT=1 docker build -t runner .                                  CPU: tensorflow-cpu, Keras 3
#   DOCKER_BUILDKIT=1 docker build --build-arg ACCELERATOR=tpu -t runner:tpu .  Cloud TPU: Keras 3 on JAX
#                                                                               (jax[tpu] 0.10.2, libtpu 0.0.42)
#   DOCKER_BUILDKIT=1 docker build --target test -t runner:test .               runtime + test dependencies
#
# Behind a TLS-inspecting proxy, hand its CA to pip as a BuildKit secret (it never lands in a layer):
#   --secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt
# Layers go from least to most often changed: venv and user, dependencies (the requirement lists drawn from
# pyproject.toml, at requirements.lock's versions), the import check, then the runner's own code.
ARG BASE_IMAGE=python:3.11-slim-bookworm
# cpu | tpu
ARG ACCELERATOR=cpu

FROM ${BASE_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/runner \
    PATH=/opt/runner/bin:$PATH
# Jobs run as an unprivileged user (uid 1000). /app/runs, the default output.dir, is theirs to write;
# /app/data is where a prepared dataset is mounted for jobs/mnist_cnn.yaml.
# tcmalloc in place of glibc's malloc: TensorFlow's input pipeline ran 1.33-1.38x faster with it
# (benchmarks/input_pipeline.py; `runner doctor` shows the allocator). `--build-arg PRELOAD=` keeps glibc's.
ARG TCMALLOC_VERSION=2.10-1
ARG PRELOAD=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
RUN apt-get update -qq \
    && apt-get install -y -qq --no-install-recommends "libtcmalloc-minimal4=${TCMALLOC_VERSION}" \
    && rm -rf /var/lib/apt/lists/*
ENV LD_PRELOAD=${PRELOAD}
RUN python3 -m venv "$VIRTUAL_ENV" \
    && groupadd --gid 1000 runner \
    && useradd --uid 1000 --gid runner --create-home --shell /usr/sbin/nologin runner \
    && mkdir -p /app/data /app/runs \
    && chown runner:runner /app/runs
WORKDIR /app
COPY scripts/image-install.sh /usr/local/bin/


# Only the requirement lists leave this stage: an edit elsewhere in pyproject.toml keeps the big
# dependency layers below cached.
FROM base AS requirements
COPY pyproject.toml ./
RUN image-install.sh list runtime >/requirements-runtime.txt \
    && image-install.sh list tpu >/requirements-tpu.txt \
    && image-install.sh list test >/requirements-test.txt


FROM base AS deps-cpu
ARG TENSORFLOW="tensorflow-cpu==2.21.0"
ENV RUNNER_USER=1000:1000
COPY requirements.lock requirements-hub-nodeps.txt ./
COPY --from=requirements /requirements-runtime.txt /tmp/
# keras-hub and tensorflow-text without their dependencies (requirements-hub-nodeps.txt says why).
RUN --mount=type=secret,id=pip_cert,required=false \
    image-install.sh pinned /tmp/requirements-runtime.txt "$TENSORFLOW" \
    && image-install.sh nodeps --requirement requirements-hub-nodeps.txt


FROM base AS deps-tpu
# Keras 3 on JAX (docs/image.md): pyproject.toml's `tpu` extra, i.e. jax's own `tpu` extra at requirements.lock's
# jax, which pins the libtpu that jax release was built with (from PyPI, as JAX's install guide says), and
# tensorflow-cpu for tf.data alone: a CPU wheel has no TPU kernels, so TensorFlow never touches the TPU JAX drives.
# requirements-tpu.lock pins the whole set. No tensorflow-tpu: Google's TensorFlow TPU runtimes stop at 2.18 and
# TPU7x runs no TensorFlow.
# The TPU image runs as root: libtpu opens the TPU devices (/dev/accel*, /dev/vfio), as `docker run
# --privileged --user 0:0` does on a TPU VM, and Vertex AI runs the image's own user with no setting for
# another (its ContainerSpec has none). docs/engines.md.
ENV RUNNER_USER=0:0
COPY requirements-tpu.lock requirements-hub-nodeps.txt ./
COPY --from=requirements /requirements-runtime.txt /requirements-tpu.txt /tmp/
RUN --mount=type=secret,id=pip_cert,required=false \
    LOCK=requirements-tpu.lock image-install.sh pinned /tmp/requirements-runtime.txt --requirement /tmp/requirements-tpu.txt \
    && image-install.sh nodeps --requirement requirements-hub-nodeps.txt


# hadolint ignore=DL3006
FROM deps-${ACCELERATOR} AS runner
ARG ACCELERATOR
LABEL org.opencontainers.image.title="runner" runner.accelerator="${ACCELERATOR}"
WORKDIR /app
# Build check: TensorFlow (tf.data's, in both images) and Keras import.
RUN TF_CPP_MIN_LOG_LEVEL=2 \
    python3 -c "import tensorflow as tf; print('TensorFlow', tf.__version__, 'Keras', tf.keras.__name__)"
COPY jobs/ jobs/
COPY pyproject.toml README.md src/
COPY runner/ src/runner/
RUN --mount=type=secret,id=pip_cert,required=false \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && pip install --no-cache-dir --no-deps ./src \
    && rm -rf src \
    && runner --help >/dev/null
# The TPU variant, checked by `runner doctor` as a user runs it: jax, jaxlib and libtpu agree with jax's `tpu`
# extra, libtpu is where JAX looks for it, `import jax` works, TensorFlow loads no libtpu, and, with no TPU in a
# build, the doctor says so with the cause and the fix instead of a traceback.
RUN if [ "$ACCELERATOR" = tpu ]; then image-install.sh check-tpu; fi
# uid 1000 for the CPU image, root for the TPU image (RUNNER_USER, set by its stage above; numeric both).
# hadolint ignore=DL3066
USER ${RUNNER_USER}
ENTRYPOINT ["runner"]
CMD ["--help"]


# The runtime plus what the test suite needs (the `test` extra, the offline-data packages, the Debian
# packages of scripts/system-deps.sh); the checkout is mounted, so the tests are the ones of the commit:
#   docker run --rm -v "$PWD:/src:ro" runner:test      the tests that need no Docker engine, gcloud or apt
FROM runner AS test
USER 0
COPY --from=requirements /requirements-test.txt /tmp/
COPY requirements-data.txt requirements-test.lock scripts/system-deps.sh ./
RUN --mount=type=secret,id=pip_cert,required=false \
    image-install.sh pinned /tmp/requirements-test.txt \
    && image-install.sh nodeps --requirement requirements-data.txt \
    && bash system-deps.sh \
    && rm -rf system-deps.sh /var/lib/apt/lists/*
WORKDIR /src
USER 1000:1000
ENTRYPOINT ["python3", "-m", "pytest"]
CMD ["-m", "not slow and not host", "-p", "no:cacheprovider"]


# The default target: the runner image.
FROM runner AS runtime
