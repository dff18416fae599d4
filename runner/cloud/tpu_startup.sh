# The body of a TPU VM startup script written by `runner submit` (runner/cloud/submit.py puts the job's settings,
# RUNNER_*, above it). It runs as root on every worker of the TPU VM at boot:
#   1. pulls the runner image (Artifact Registry credentials come from the VM's service account);
#   2. runs `runner doctor` (its report goes to RUN_DIR/doctor.json), then the job: `--net=host --privileged`
#      give the container the TPU chips, TPU_NAME=local says the TPU is this VM's own; stdout and stderr go
#      to RUN_DIR/logs/worker-N.log every 30 s and at the end. On a multi-host slice TensorFlow drives every
#      host from one client: worker 0 runs the job with TPU_NAME=<the slice's name> (the resolver finds the
#      other hosts through the TPU API) and TPU_LOAD_LIBRARY=0 (the chips stay with each host's TPU
#      runtime); the other workers run nothing but that runtime;
#   3. writes RUN_DIR/logs/worker-N.exit.json (exit code, start and end, TPU type, price per chip-hour);
#   4. on worker 0, deletes the queued resource that holds the VM, unless the job was submitted with --keep.
set -uo pipefail

metadata() {
  curl -sf -H 'Metadata-Flavor: Google' "http://metadata.google.internal/computeMetadata/v1/instance/attributes/$1"
}
stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }

worker="$(metadata agent-worker-number || echo 0)"
workdir="${RUNNER_WORKDIR:-/var/lib/runner/$RUNNER_NAME}"
log="$workdir/worker-$worker.log"
logs="$RUNNER_RUN_DIR/logs"
mkdir -p "$workdir"
upload() { gcloud storage cp --quiet "$log" "$logs/worker-$worker.log" >/dev/null 2>&1 || true; }
say() { echo "runner-startup: $*" | tee -a "$log"; }

# A startup script runs again at every boot: a job that finished on this worker is not run twice.
if gcloud storage ls "$logs/worker-$worker.exit.json" >/dev/null 2>&1; then
  say "job $RUNNER_NAME already finished on worker $worker ($logs/worker-$worker.exit.json)"
  exit 0
fi
hosts="$(metadata worker-network-endpoints | tr ',' '\n' | grep -c . || true)"
tpu_env=(-e TPU_NAME=local)
if [ "${hosts:-1}" -gt 1 ]; then
  if [ "$worker" != 0 ]; then
    say "worker $worker of $hosts: worker 0 drives the slice through TensorFlow; nothing to run here"
    exit 0
  fi
  tpu_env=(-e TPU_NAME="$RUNNER_NAME" -e TPU_LOAD_LIBRARY=0)
fi
started="$(stamp)"
printf '%s' "$RUNNER_SPEC_B64" | base64 -d >"$workdir/spec.yaml"
say "worker $worker: job $RUNNER_NAME, image $RUNNER_IMAGE, run folder $RUNNER_RUN_DIR"

registry="${RUNNER_IMAGE%%/*}"
case "$registry" in
  *-docker.pkg.dev | gcr.io | *.gcr.io) gcloud auth configure-docker "$registry" --quiet >>"$log" 2>&1 ;;
esac
pulled=1
for attempt in 1 2 3 4 5; do
  if docker pull "$RUNNER_IMAGE" >>"$log" 2>&1; then pulled=0; break; fi
  say "docker pull failed (attempt $attempt of 5)"
  sleep $((attempt * 10))
done

code=3
if [ "$pulled" -eq 0 ]; then
  # A lockfile left by a killed TPU process keeps the next one from opening the chips.
  rm -f /tmp/libtpu_lockfile
  (while sleep 30; do upload; done) </dev/null >/dev/null 2>&1 &
  uploader=$!
  # Root inside the container: libtpu opens the TPU devices and pins host memory for them.
  # The doctor's report is kept beside the summary; the job runs either way (a failing check names the
  # cause in the log before the job meets it).
  docker run --rm --net=host --privileged --user 0:0 "${tpu_env[@]}" \
    -v "$workdir:/job:ro" "$RUNNER_IMAGE" doctor --json --save /job/spec.yaml >>"$log" 2>&1 ||
    say "runner doctor reported a failing check (exit $?); see doctor.json in the run folder"
  docker run --rm --name "runner-$RUNNER_NAME" --net=host --privileged --user 0:0 \
    "${tpu_env[@]}" -e RUNNER_WORKER="$worker" \
    -v "$workdir:/job:ro" "$RUNNER_IMAGE" run /job/spec.yaml >>"$log" 2>&1
  code=$?
  kill "$uploader" 2>/dev/null
fi
say "job exited with code $code"
upload
printf '{"worker": %s, "exit_code": %s, "started_at": "%s", "finished_at": "%s", "accelerator_type": "%s", "spot": %s, "usd_per_chip_hour": %s}\n' \
  "$worker" "$code" "$started" "$(stamp)" "$RUNNER_TPU_TYPE" "$RUNNER_SPOT" "$RUNNER_USD_PER_CHIP_HOUR" >"$workdir/exit.json"
gcloud storage cp --quiet "$workdir/exit.json" "$logs/worker-$worker.exit.json" >/dev/null 2>&1 || true

if [ "$worker" = 0 ] && [ "$RUNNER_KEEP" != 1 ]; then
  gcloud compute tpus queued-resources delete "$RUNNER_NAME" --project "$RUNNER_PROJECT" --zone "$RUNNER_ZONE" \
    --force --quiet --async >>"$log" 2>&1
fi
