# The runner image: `runner` is the entrypoint, so `docker run IMAGE run jobs/mnist_cnn.yaml` trains a job.
#
#   DOCKER_BUILDKIT=1 docker build -t runner .                                  CPU: tensorflow-cpu, Keras 3
#   DOCKER_BUILDKIT=1 docker build --build-arg ACCELERATOR=tpu -t runner:tpu .  Cloud TPU VM: tensorflow-tpu
#                                                                               2.19.1, libtpu 0.0.10, Keras 3
#   DOCKER_BUILDKIT=1 docker build --target test -t runner:test .               runtime + test dependencies
#
# Behind a TLS-inspecting proxy, hand its CA to pip as a BuildKit secret (it never lands in a layer):
#   --secret id=pip_cert,src=/etc/ssl/certs/ca-certificates.crt
# Layers go from least to most often changed: venv and user, dependencies (the requirement lists drawn from
# pyproject.toml, at requirements.lock's versions), the TensorFlow import check, then the runner's own code.
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
    && image-install.sh list test >/requirements-test.txt


FROM base AS tf-cpu
ARG TENSORFLOW="tensorflow-cpu==2.21.0"
# tf-keras comes along for the jobs that need it (multi-worker training: runner/device/flavour.py picks it there).
ARG TF_KERAS="tf-keras==2.21.0"
ENV RUNNER_USER=1000:1000
COPY requirements.lock ./
COPY --from=requirements /requirements-runtime.txt /tmp/
RUN --mount=type=secret,id=pip_cert,required=false \
    image-install.sh pinned /tmp/requirements-runtime.txt "$TENSORFLOW" \
    && image-install.sh nodeps "$TF_KERAS"


FROM base AS tf-tpu
# TensorFlow, libtpu and Keras from Keras's TensorFlow TPU example, the one documented PJRT recipe for a
# tensorflow-tpu from PyPI (https://keras.io/keras_rs/examples/distributed_embedding_tf): tensorflow-tpu
# 2.19.1, whose wheel pins libtpu==0.0.10, and Keras 3. Google's runtime table stops at TF 2.18.0 (libtpu
# 1.12.0, tpu-vm-tf-2.18.0-pjrt), whose libtpu is only on Google's own index. docs/tpu.md has the sources.
# Its versions are pinned by requirements-tpu.lock (TF 2.19 wants protobuf<6, numpy<2.2: not the CPU lock).
ARG TENSORFLOW="tensorflow-tpu==2.19.1"
ARG LIBTPU="libtpu==0.0.10"
# tf-keras for TF_USE_LEGACY_KERAS=1 (Keras 2, as Google's own TensorFlow TPU CI runs); Keras 3 by default.
ARG TF_KERAS="tf-keras==2.19.0"
ARG TF_USE_LEGACY_KERAS=0
ENV TF_USE_LEGACY_KERAS=${TF_USE_LEGACY_KERAS}
# The TPU image runs as root: libtpu opens the TPU devices (/dev/accel*, /dev/vfio), as `docker run
# --privileged --user 0:0` does on a TPU VM, and Vertex AI runs the image's own user with no setting for
# another (its ContainerSpec has none). docs/engines.md.
ENV RUNNER_USER=0:0
COPY requirements-tpu.lock ./
COPY --from=requirements /requirements-runtime.txt /tmp/
RUN --mount=type=secret,id=pip_cert,required=false \
    LOCK=requirements-tpu.lock image-install.sh pinned /tmp/requirements-runtime.txt "$TENSORFLOW" "$LIBTPU" \
    && image-install.sh nodeps "$TF_KERAS" \
    && image-install.sh check-libtpu "$LIBTPU"


# hadolint ignore=DL3006
FROM tf-${ACCELERATOR} AS runner
ARG ACCELERATOR
LABEL org.opencontainers.image.title="runner" runner.accelerator="${ACCELERATOR}"
WORKDIR /app
# Build check: this variant's TensorFlow and Keras import (a libtpu that does not match aborts right here).
# Off a TPU VM, libtpu would spend minutes asking the metadata server for the TPU's topology: skip that.
RUN TF_CPP_MIN_LOG_LEVEL=2 TPU_SKIP_MDS_QUERY=1 \
    python3 -c "import tensorflow as tf; print('TensorFlow', tf.__version__, 'Keras', tf.keras.__name__)"
COPY jobs/ jobs/
COPY pyproject.toml README.md src/
COPY runner/ src/runner/
RUN --mount=type=secret,id=pip_cert,required=false \
    if [ -s /run/secrets/pip_cert ]; then export PIP_CERT=/run/secrets/pip_cert; fi \
    && pip install --no-cache-dir --no-deps ./src \
    && rm -rf src \
    && runner --help >/dev/null
# The TPU variant: the PJRT settings `runner run` makes for a v5e/v5p/v6e load libtpu as TensorFlow's plugin.
RUN if [ "$ACCELERATOR" = tpu ]; then image-install.sh check-pjrt; fi
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
