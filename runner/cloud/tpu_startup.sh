# The body of a TPU VM startup script written by `runner submit` (runner/cloud/submit.py puts the job's
# settings, RUNNER_*, above it). It runs as root on every worker of the TPU VM at every boot:
#   1. reads this worker's number from the metadata server; a worker that cannot learn it runs nothing and
#      deletes nothing (only a worker that knows it is worker 0 deletes the slice);
#   2. stops early when the job is already complete (RUN_DIR/summary.json: succeeded for the requested
#      epochs) or when this submission already ran on this worker (a reboot);
#   3. pulls the runner image (Artifact Registry credentials come from the VM's service account);
#   4. runs `runner doctor` (its report goes to RUN_DIR/doctor.json), then the job: `--net=host --privileged`
#      give the container the TPU chips, TPU_NAME=local says the TPU is this VM's own. The container's
#      output goes to Cloud Logging (docker's gcplogs driver: seconds behind) and to
#      RUN_DIR/logs/SUB/worker-N.log (copied every 30 s and at the end: the durable record). A slice of
#      several hosts (refused by `runner submit`) runs nothing;
#   5. writes RUN_DIR/logs/SUB/worker-N.exit.json (exit code, or why nothing ran; start and end; TPU type);
#   6. on worker 0, deletes the queued resource that holds the VM, unless the job was submitted with --keep.
# Every path that runs no job still does 5 and 6, and says why in the log. SUB is this submission's id.
set -uo pipefail

metadata_host="${GCE_METADATA_HOST:-metadata.google.internal}"
metadata() {
  curl -sf --max-time 5 -H 'Metadata-Flavor: Google' "http://$metadata_host/computeMetadata/v1/instance/attributes/$1"
}
stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }
started="$(stamp)"

# The metadata server can be slow to answer right after boot: retry, and never guess the number.
worker=""
for attempt in $(seq "${RUNNER_METADATA_TRIES:-10}"); do
  if answer="$(metadata agent-worker-number)" && [[ "$answer" =~ ^[0-9]+$ ]]; then worker="$answer"; break; fi
  sleep "${RUNNER_METADATA_RETRY_S:-3}"
done
known_worker=1
worker_json="$worker"
if [ -z "$worker" ]; then known_worker=0; worker=unknown; worker_json='"unknown"'; fi

workdir="${RUNNER_WORKDIR:-/var/lib/runner/$RUNNER_NAME/$RUNNER_SUBMISSION}"
logs="$RUNNER_RUN_DIR/logs/$RUNNER_SUBMISSION"
log="$workdir/worker-$worker.log"
mkdir -p "$workdir"
upload() { gcloud storage cp --quiet "$log" "$logs/worker-$worker.log" >/dev/null 2>&1 || true; }
say() { echo "runner-startup: $(stamp) $*" | tee -a "$log"; }

# The exit record a watcher and `runner logs` read: CODE RAN(true|false) REASON (no quotes in REASON).
record_exit() {
  printf '{"worker": %s, "submission": "%s", "exit_code": %s, "ran": %s, "reason": "%s", "started_at": "%s", "finished_at": "%s", "accelerator_type": "%s", "spot": %s, "usd_per_chip_hour": %s}\n' \
    "$worker_json" "$RUNNER_SUBMISSION" "$1" "$2" "$3" "$started" "$(stamp)" "$RUNNER_TPU_TYPE" "$RUNNER_SPOT" \
    "$RUNNER_USD_PER_CHIP_HOUR" >"$workdir/exit.json"
  for attempt in 1 2 3; do
    gcloud storage cp --quiet "$workdir/exit.json" "$logs/worker-$worker.exit.json" >/dev/null 2>&1 && return 0
    sleep 2
  done
  say "could not copy the exit record to $logs/worker-$worker.exit.json"
}

# Frees the slice once its job is over: only worker 0 (known to be 0), and not with --keep. REASON is logged.
release() {
  if [ "$known_worker" != 1 ]; then
    say "not deleting queued resource $RUNNER_NAME: this worker does not know its number, and only worker 0 deletes (the watcher, or runner cancel $RUNNER_NAME, frees it)"
  elif [ "$worker" != 0 ]; then
    return 0
  elif [ "$RUNNER_KEEP" = 1 ]; then
    say "keeping queued resource $RUNNER_NAME (--keep) after: $1; it bills until runner cancel $RUNNER_NAME"
  else
    say "deleting queued resource $RUNNER_NAME: $1"
    upload  # deleting the queued resource ends this VM: the log goes first
    gcloud compute tpus queued-resources delete "$RUNNER_NAME" --project "$RUNNER_PROJECT" --zone "$RUNNER_ZONE" \
      --force --quiet --async >>"$log" 2>&1 || say "the delete request failed (see above): runner cancel $RUNNER_NAME frees the slice"
  fi
  upload
}

# Every path that runs no job ends here: CODE REASON.
end_without_job() {
  say "$2"
  record_exit "$1" false "$2"
  release "$2"
  exit 0
}

say "worker $worker: job $RUNNER_NAME, submission $RUNNER_SUBMISSION, image $RUNNER_IMAGE, run folder $RUNNER_RUN_DIR"
if [ "$known_worker" != 1 ]; then
  end_without_job 3 "cannot read this worker's number from the metadata server ($metadata_host): ran nothing, since a worker that may not be worker 0 must neither drive the slice nor delete it"
fi

# A startup script runs again at every boot: a submission that already ran on this worker is not run twice.
if gcloud storage ls "$logs/worker-$worker.exit.json" >/dev/null 2>&1; then
  say "submission $RUNNER_SUBMISSION already ran on worker $worker ($logs/worker-$worker.exit.json): not running it again after a reboot"
  release "submission $RUNNER_SUBMISSION had already ended"
  exit 0
fi

# A complete job (runner/rundir/outputs.py's rule: summary.json says succeeded for at least the requested epochs)
# is not run again; an old exit record says nothing about that.
if [ -n "${RUNNER_EPOCHS:-}" ]; then
  if ! command -v python3 >/dev/null; then
    say "python3 is missing on this VM: the job itself will check whether it is complete"
  elif summary="$(gcloud storage cat "$RUNNER_RUN_DIR/summary.json" 2>/dev/null)" &&
    printf '%s' "$summary" | python3 -c 'import json, sys
s = json.load(sys.stdin)
sys.exit(0 if s.get("status") == "succeeded" and int(s.get("train_epochs") or 0) >= int(sys.argv[1]) else 1)' "$RUNNER_EPOCHS" 2>/dev/null; then
    end_without_job 0 "job $RUNNER_NAME is already complete: $RUNNER_RUN_DIR/summary.json says succeeded for at least $RUNNER_EPOCHS epochs; nothing to run (raise train.epochs to continue it)"
  fi
fi

# `runner submit` refuses multi-host types (docs/tpu.md says why); a slice of several hosts that gets here
# anyway runs nothing, and worker 0 frees it rather than let it bill.
hosts="$(metadata worker-network-endpoints | tr ',' '\n' | grep -c . || true)"
tpu_env=(-e TPU_NAME=local -e RUNNER_TPU_RUNTIME_VERSION="$RUNNER_TPU_RUNTIME_VERSION")
if [ "${hosts:-0}" -gt 1 ]; then
  if [ "$worker" != 0 ]; then
    say "worker $worker of $hosts: multi-host slices are not supported; worker 0 frees the slice"
    exit 0
  fi
  end_without_job 2 "this slice has $hosts hosts: multi-host slices are not supported (docs/tpu.md); ran nothing"
fi
printf '%s' "$RUNNER_SPEC_B64" | base64 -d >"$workdir/spec.yaml"

# Artifact Registry: docker asks gcloud's credential helper, which must be on PATH; without it, a
# configured helper makes every pull fail, so log in with the VM's access token instead.
registry="${RUNNER_IMAGE%%/*}"
case "$registry" in
  *-docker.pkg.dev | gcr.io | *.gcr.io)
    if helper="$(command -v docker-credential-gcloud)"; then
      gcloud auth configure-docker "$registry" --quiet >>"$log" 2>&1
      say "registry $registry: docker uses gcloud's credential helper ($helper)"
    else
      say "registry $registry: docker-credential-gcloud is not on PATH; logging docker in with the VM's access token"
      gcloud auth print-access-token 2>>"$log" | docker login -u oauth2accesstoken --password-stdin "https://$registry" >>"$log" 2>&1 ||
        say "docker login to $registry failed: the pull below will say why"
    fi
    ;;
esac
pulled=1
for attempt in 1 2 3 4 5; do
  if docker pull "$RUNNER_IMAGE" >>"$log" 2>&1; then pulled=0; break; fi
  say "docker pull failed (attempt $attempt of 5)"
  [ "$attempt" = 5 ] || sleep $((attempt * ${RUNNER_PULL_RETRY_S:-10}))
done
if [ "$pulled" != 0 ]; then
  end_without_job 3 "cannot pull $RUNNER_IMAGE (5 attempts; the log above has docker's answer): ran nothing"
fi

# libtpu's lockfile (/tmp/libtpu_lockfile) lives in the container's own /tmp, which every `docker run --rm`
# starts empty: a lockfile left by a killed run goes with its container, so the host has nothing to clear.
# Root inside the container: libtpu opens the TPU devices and pins host memory for them.
container="runner-$RUNNER_NAME-$RUNNER_SUBMISSION-w$worker"
cloud_logging=(--log-driver=gcplogs --log-opt gcp-log-cmd=false --log-opt labels=runner-job,runner-submission)
labels=(--label "runner-job=$RUNNER_NAME" --label "runner-submission=$RUNNER_SUBMISSION")
doctor=(--rm --net=host --privileged --user 0:0 "${tpu_env[@]}" -v "$workdir:/job:ro")
doctor_args=(doctor --json --save /job/spec.yaml)
# The doctor's report is kept beside the summary; the job runs either way (a failing check names the cause
# in the log before the job meets it). It also tries Cloud Logging: docker refuses to start a container
# (exit 125) when its log driver cannot reach Cloud Logging, and then the job logs to the bucket only.
docker run "${doctor[@]}" "${cloud_logging[@]}" "${labels[@]}" --name "$container-doctor" "$RUNNER_IMAGE" "${doctor_args[@]}" >>"$log" 2>&1
checked=$?
log_driver=gcplogs
if [ "$checked" = 125 ]; then
  say "docker could not start a container with the gcplogs log driver (Cloud Logging: the VM needs the logging.write scope and roles/logging.logWriter); the log goes to the bucket only"
  cloud_logging=()
  log_driver=json-file
  docker run "${doctor[@]}" "${labels[@]}" --name "$container-doctor" "$RUNNER_IMAGE" "${doctor_args[@]}" >>"$log" 2>&1
  checked=$?
fi
[ "$checked" = 0 ] || say "runner doctor reported a failing check (exit $checked); see doctor.json in the run folder"

printf '{"worker": %s, "submission": "%s", "started_at": "%s", "log_driver": "%s", "container": "%s"}\n' \
  "$worker_json" "$RUNNER_SUBMISSION" "$(stamp)" "$log_driver" "$container" >"$workdir/started.json"
gcloud storage cp --quiet "$workdir/started.json" "$logs/worker-$worker.started.json" >/dev/null 2>&1 || true
say "starting the job in container $container (log driver $log_driver)"
(while sleep "${RUNNER_UPLOAD_EVERY_S:-30}"; do upload; done) </dev/null >/dev/null 2>&1 &
uploader=$!
docker run --rm --name "$container" --net=host --privileged --user 0:0 "${cloud_logging[@]}" "${labels[@]}" \
  "${tpu_env[@]}" -e RUNNER_WORKER="$worker" -v "$workdir:/job:ro" "$RUNNER_IMAGE" run /job/spec.yaml >>"$log" 2>&1
code=$?
kill "$uploader" 2>/dev/null
say "job exited with code $code"
record_exit "$code" true "the job exited with code $code"
release "the job exited with code $code"
