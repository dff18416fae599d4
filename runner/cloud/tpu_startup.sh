# The body of a TPU VM startup script written by `runner submit` (runner/cloud/request.py puts the job's
# settings, RUNNER_*, above it). It runs as root on every worker (TPU VM) of the slice at every boot:
#   1. reads this worker's number from the metadata server. A worker that cannot learn its number goes on as
#      worker 0 only on a slice of one host (RUNNER_HOSTS=1) and says so; on a slice of several it runs nothing
#      and deletes nothing;
#   2. stops early when the job is already complete (RUN_DIR/summary.json: succeeded for the requested
#      epochs) or when this submission already ran on this worker (a reboot);
#   3. pulls the runner image (Artifact Registry credentials come from the VM's service account);
#   4. runs `runner doctor` (its report goes to RUN_DIR/doctor.json), then the job: `--net=host --privileged`
#      give the container the TPU chips and the metadata server, from which `runner run` on every worker of a
#      multi-host slice joins one JAX process group (jax.distributed.initialize() finds the slice itself);
#      TPU_NAME=local says the TPU is this VM's own. The container's output goes to Cloud Logging (docker's
#      gcplogs driver: seconds behind) and to RUN_DIR/logs/SUB/worker-N.log (copied every 30 s and at the
#      end: the durable record). The job gets its limits on its command line (`--set train.max_duration=S
#      --set train.stall_timeout=S`: it saves and exits 124 at either), and the container is killed
#      RUNNER_LIMIT_GRACE_S after the wall-clock limit if it is still there (`timeout`). Code sent with the job
#      reaches the container as RUNNER_CODE (the archive's URL and sha256), which `runner run` fetches;
#   5. writes RUN_DIR/logs/SUB/worker-N.exit.json (exit code, or why nothing ran; start and end; TPU type);
#   6. deletes the queued resource that holds the slice, unless the job was submitted with --keep, retrying with
#      backoff for up to RUNNER_DELETE_FOR_S (10 min), and writes the outcome into the exit record ("delete":
#      requested | failed: still billing | kept | ...), which `runner status` shows. Worker 0 deletes when its
#      job ends. On a multi-host slice every other worker, once its own job has ended, waits for that and
#      deletes only if worker 0 is lost: worker 0's heartbeat (RUN_DIR/logs/SUB/worker-0.alive, rewritten every
#      RUNNER_UPLOAD_EVERY_S while its script runs) has not changed for RUNNER_WORKER_LOST_S (300 s) and the
#      queued resource is neither DELETING nor gone. Worker N looks again (N-1) x RUNNER_PEER_STAGGER_S later
#      before it deletes, so that of several survivors the first one does: the slice is deleted once.
# Every path that runs no job still does 5 and 6, and says why in the log. SUB is this submission's id.
# Every call that waits on the network, the registry or a container is bounded in time (`bounded`): the image
# pull (RUNNER_PULL_TIMEOUT_S per attempt, RUNNER_PULL_FOR_S in all), the doctor (RUNNER_DOCTOR_TIMEOUT_S),
# each gcloud call; the job itself by its wall-clock limit. A hang anywhere still ends in 5 and 6.
# Nothing here relaunches a job: after exit 124 (a time limit or a stall) or any other end, the slice goes.
set -uo pipefail

metadata_host="${GCE_METADATA_HOST:-metadata.google.internal}"
metadata() {
  curl -sf --max-time 5 -H 'Metadata-Flavor: Google' "http://$metadata_host/computeMetadata/v1/instance/attributes/$1"
}
stamp() { date -u +%Y-%m-%dT%H:%M:%SZ; }
started="$(stamp)"
# LIMIT COMMAND...: COMMAND, ended with TERM after LIMIT seconds (KILL 10 s later); its exit code, 124 if it
# timed out.
bounded() {
  local limit="$1"
  shift
  timeout --kill-after=10 "$limit" "$@"
}

# The metadata server can be slow to answer right after boot: retry, and never guess the number.
worker=""
for attempt in $(seq "${RUNNER_METADATA_TRIES:-10}"); do
  if answer="$(metadata agent-worker-number)" && [[ "$answer" =~ ^[0-9]+$ ]]; then worker="$answer"; break; fi
  sleep "${RUNNER_METADATA_RETRY_S:-3}"
done
known_worker=1
worker_note=""
if [ -z "$worker" ] && [ "${RUNNER_HOSTS:-1}" = 1 ]; then
  worker=0
  worker_note="the metadata server ($metadata_host) did not give this worker's number; this slice has one host (RUNNER_HOSTS=1, from runner/device/tpus.json for $RUNNER_TPU_TYPE), so this is worker 0"
elif [ -z "$worker" ]; then
  known_worker=0
  worker=unknown
fi
worker_json="$worker"
[ "$known_worker" = 1 ] || worker_json='"unknown"'
delete_outcome="pending"  # what the exit record says until the delete has an answer (the VM may go first)
delete_attempts=0

workdir="${RUNNER_WORKDIR:-/var/lib/runner/$RUNNER_NAME/$RUNNER_SUBMISSION}"
logs="$RUNNER_RUN_DIR/logs/$RUNNER_SUBMISSION"
log="$workdir/worker-$worker.log"
mkdir -p "$workdir"
upload() { bounded 120 gcloud storage cp --quiet "$log" "$logs/worker-$worker.log" >/dev/null 2>&1 || true; }
say() { echo "runner-startup: $(stamp) $*" | tee -a "$log"; }

# The exit record a watcher and `runner logs` read: CODE RAN(true|false) REASON (no quotes in REASON). It is
# written once when the job ends and again with the outcome of the slice's delete.
record_exit() {
  exit_args=("$1" "$2" "$3")
  write_exit_record
}
write_exit_record() {
  printf '{"worker": %s, "submission": "%s", "exit_code": %s, "ran": %s, "reason": "%s", "started_at": "%s", "finished_at": "%s", "accelerator_type": "%s", "spot": %s, "usd_per_chip_hour": %s, "max_run_s": "%s", "stall_timeout_s": "%s", "delete": "%s", "delete_attempts": %s}\n' \
    "$worker_json" "$RUNNER_SUBMISSION" "${exit_args[0]}" "${exit_args[1]}" "${exit_args[2]}" "$started" "$(stamp)" \
    "$RUNNER_TPU_TYPE" "$RUNNER_SPOT" "$RUNNER_USD_PER_CHIP_HOUR" "${RUNNER_MAX_RUN_S:-}" "${RUNNER_STALL_TIMEOUT_S:-}" \
    "$delete_outcome" "$delete_attempts" >"$workdir/exit.json"
  for attempt in 1 2 3; do
    bounded 120 gcloud storage cp --quiet "$workdir/exit.json" "$logs/worker-$worker.exit.json" >/dev/null 2>&1 && return 0
    sleep 2
  done
  say "could not copy the exit record to $logs/worker-$worker.exit.json"
}

# Frees the slice once its job is over: worker 0, or on a multi-host slice another worker when worker 0 is lost
# (await_worker_0); never with --keep. REASON is logged. A refused or unanswered delete is tried again with backoff
# (RUNNER_DELETE_RETRY_S, whole seconds, doubling to 60) for up to RUNNER_DELETE_FOR_S; either way the outcome
# goes into the exit record (when one was written).
release() {
  if [ "$known_worker" != 1 ]; then
    delete_outcome="not this worker: its number is unknown"
    say "not deleting queued resource $RUNNER_NAME: this worker does not know its number, and only worker 0 deletes (the watcher, or runner cancel $RUNNER_NAME, frees it)"
  elif [ "$RUNNER_KEEP" = 1 ]; then
    delete_outcome="kept (--keep): still billing until runner cancel $RUNNER_NAME"
    [ "$worker" != 0 ] || say "keeping queued resource $RUNNER_NAME (--keep) after: $1; it bills until runner cancel $RUNNER_NAME"
  elif [ "$worker" = 0 ]; then
    say "deleting queued resource $RUNNER_NAME: $1"
    upload  # deleting the queued resource ends this VM: the log goes first
    delete_slice
  elif [ "${RUNNER_HOSTS:-1}" -gt 1 ]; then
    await_worker_0 "$1"
  else
    delete_outcome="left to worker 0"
  fi
  [ "${#exit_args[@]}" = 0 ] || write_exit_record
  upload
}

# The queued resource's state as the API gives it (ACTIVE, DELETING, ...), `gone`, or `unknown` (no answer).
slice_state() {
  local answer
  if answer="$(bounded 120 gcloud compute tpus queued-resources describe "$RUNNER_NAME" --project "$RUNNER_PROJECT" \
    --zone "$RUNNER_ZONE" --format 'value(state.state)' 2>&1)"; then
    printf '%s\n' "$answer" | tail -n 1
  elif [[ "$answer" == *NOT_FOUND* ]]; then
    echo gone
  else
    echo unknown
  fi
}

# Another worker of a multi-host slice, its own job over: worker 0 deletes the slice when its job ends (JAX ends
# every process of the group when one fails, within its heartbeat timeout). This worker waits for that, and
# deletes the slice itself only when worker 0 is lost: its heartbeat has not changed for RUNNER_WORKER_LOST_S
# (as this worker sees it: no clocks compared), and the queued resource is still there and not DELETING, also
# (N-1) x RUNNER_PEER_STAGGER_S later, when worker N looks again.
await_worker_0() {
  local seen="" since=$SECONDS beat state lost_s="${RUNNER_WORKER_LOST_S:-300}"
  delete_outcome="left to worker 0"
  say "worker $worker: waiting for worker 0 to delete queued resource $RUNNER_NAME (worker 0 counts as lost once its heartbeat $logs/worker-0.alive stops for $lost_s s)"
  while true; do
    state="$(slice_state)"
    if [ "$state" = gone ] || [ "$state" = DELETING ]; then
      say "queued resource $RUNNER_NAME is ${state}: deleted by another worker"
      delete_outcome="left to worker 0 (the slice was $state)"
      return 0
    fi
    beat="$(bounded 60 gcloud storage cat "$logs/worker-0.alive" 2>/dev/null)"
    if [ "$beat" != "$seen" ]; then
      seen="$beat"
      since=$SECONDS
    elif [ $((SECONDS - since)) -ge "$lost_s" ]; then
      sleep $(((worker - 1) * ${RUNNER_PEER_STAGGER_S:-60}))
      state="$(slice_state)"
      if [ "$state" = gone ] || [ "$state" = DELETING ]; then
        say "queued resource $RUNNER_NAME is ${state}: deleted by another worker"
        delete_outcome="left to another worker (the slice was $state)"
        return 0
      fi
      say "worker 0 is lost (its heartbeat has not changed for $((SECONDS - since)) s): worker $worker deletes queued resource $RUNNER_NAME: $1"
      upload
      delete_slice
      return
    fi
    sleep "${RUNNER_PEER_POLL_S:-15}"
  done
}

# Worker 0's heartbeat on a multi-host slice, for the other workers (await_worker_0): a count and a time,
# rewritten every RUNNER_UPLOAD_EVERY_S while this script runs; it stops with the script, or with the VM.
beat() {
  local count=0
  while true; do
    count=$((count + 1))
    printf '%s %s\n' "$count" "$(stamp)" >"$workdir/alive"
    bounded 60 gcloud storage cp --quiet "$workdir/alive" "$logs/worker-0.alive" >/dev/null 2>&1
    sleep "${RUNNER_UPLOAD_EVERY_S:-30}"
  done
}

delete_slice() {
  local wait_s="${RUNNER_DELETE_RETRY_S:-10}" began=$SECONDS
  while true; do
    delete_attempts=$((delete_attempts + 1))
    if answer="$(bounded 330 gcloud compute tpus queued-resources delete "$RUNNER_NAME" --project "$RUNNER_PROJECT" \
      --zone "$RUNNER_ZONE" --force --quiet --async 2>&1)"; then
      printf '%s\n' "$answer" >>"$log"
      delete_outcome="requested"
      say "delete of queued resource $RUNNER_NAME requested (attempt $delete_attempts)"
      return 0
    fi
    printf '%s\n' "$answer" >>"$log"
    if [[ "$answer" == *NOT_FOUND* ]]; then  # deleted already (a reboot after the first delete, runner cancel)
      delete_outcome="already gone"
      say "queued resource $RUNNER_NAME is already gone"
      return 0
    fi
    if [ $((SECONDS - began)) -ge "${RUNNER_DELETE_FOR_S:-600}" ]; then
      delete_outcome="failed: still billing, run runner cancel $RUNNER_NAME"
      say "delete failed $delete_attempts times over $((SECONDS - began)) s (see above): queued resource $RUNNER_NAME is still billing; run runner cancel $RUNNER_NAME"
      return 1
    fi
    say "the delete request failed (attempt $delete_attempts, see above); trying again in $wait_s s"
    sleep "$wait_s"
    wait_s=$((wait_s * 2 > 60 ? 60 : wait_s * 2))
  done
}
exit_args=()

# Every path that runs no job ends here: CODE REASON.
end_without_job() {
  say "$2"
  record_exit "$1" false "$2"
  release "$2"
  exit 0
}

say "worker $worker of ${RUNNER_HOSTS:-1}: job $RUNNER_NAME, submission $RUNNER_SUBMISSION, image $RUNNER_IMAGE, run folder $RUNNER_RUN_DIR"
[ -z "$worker_note" ] || say "$worker_note"
if [ "${RUNNER_HOSTS:-1}" -gt 1 ] && [ "$worker" = 0 ]; then
  beat </dev/null >/dev/null 2>&1 &
  heartbeat=$!
  trap 'kill "$heartbeat" 2>/dev/null' EXIT
fi
if [ "$known_worker" != 1 ]; then
  end_without_job 3 "cannot read this worker's number from the metadata server ($metadata_host) on a slice of $RUNNER_HOSTS hosts: ran nothing, since a worker that may not be worker 0 must neither drive the slice nor delete it"
fi

# A startup script runs again at every boot: a submission that already ran on this worker is not run twice.
if bounded 120 gcloud storage ls "$logs/worker-$worker.exit.json" >/dev/null 2>&1; then
  say "submission $RUNNER_SUBMISSION already ran on worker $worker ($logs/worker-$worker.exit.json): not running it again after a reboot"
  release "submission $RUNNER_SUBMISSION had already ended"
  exit 0
fi

# A complete job (runner/rundir/outputs.py's rule: summary.json says succeeded for at least the requested epochs)
# is not run again; an old exit record says nothing about that.
if [ -n "${RUNNER_EPOCHS:-}" ]; then
  if ! command -v python3 >/dev/null; then
    say "python3 is missing on this VM: the job itself will check whether it is complete"
  elif summary="$(bounded 120 gcloud storage cat "$RUNNER_RUN_DIR/summary.json" 2>/dev/null)" &&
    printf '%s' "$summary" | python3 -c 'import json, sys
s = json.load(sys.stdin)
sys.exit(0 if s.get("status") == "succeeded" and int(s.get("train_epochs") or 0) >= int(sys.argv[1]) else 1)' "$RUNNER_EPOCHS" 2>/dev/null; then
    end_without_job 0 "job $RUNNER_NAME is already complete: $RUNNER_RUN_DIR/summary.json says succeeded for at least $RUNNER_EPOCHS epochs; nothing to run (raise train.epochs to continue it)"
  fi
fi

# The slice's hosts as the metadata server lists them; JAX reads the same list (worker-network-endpoints), so a
# count that differs from the submission's is said (the TPU table would be wrong for this type).
hosts="$(metadata worker-network-endpoints | tr ',' '\n' | grep -c . || true)"
if [ "${hosts:-0}" -gt 0 ] && [ "$hosts" != "${RUNNER_HOSTS:-1}" ]; then
  say "the metadata server lists $hosts workers in this slice, the submission expected ${RUNNER_HOSTS:-1} (runner/device/tpus.json); JAX follows the metadata server"
fi
tpu_env=(-e TPU_NAME=local -e RUNNER_TPU_RUNTIME_VERSION="$RUNNER_TPU_RUNTIME_VERSION" -e RUNNER_TPU_TYPE="$RUNNER_TPU_TYPE")
# The code sent with the job (docs/cloud.md, "Sending your code"): `runner run` fetches, checks and unpacks it.
code_env=()
[ -z "${RUNNER_CODE:-}" ] || code_env=(-e "RUNNER_CODE=${RUNNER_CODE:-}")
printf '%s' "$RUNNER_SPEC_B64" | base64 -d >"$workdir/spec.yaml"

# Artifact Registry: docker asks gcloud's credential helper, which must be on PATH; without it, a
# configured helper makes every pull fail, so log in with the VM's access token instead.
registry="${RUNNER_IMAGE%%/*}"
case "$registry" in
  *-docker.pkg.dev | gcr.io | *.gcr.io)
    if helper="$(command -v docker-credential-gcloud)"; then
      bounded 120 gcloud auth configure-docker "$registry" --quiet >>"$log" 2>&1
      say "registry $registry: docker uses gcloud's credential helper ($helper)"
    else
      say "registry $registry: docker-credential-gcloud is not on PATH; logging docker in with the VM's access token"
      bounded 60 gcloud auth print-access-token 2>>"$log" |
        bounded 60 docker login -u oauth2accesstoken --password-stdin "https://$registry" >>"$log" 2>&1 ||
        say "docker login to $registry failed: the pull below will say why"
    fi
    ;;
esac
pulled=1
pull_began=$SECONDS
for attempt in 1 2 3 4 5; do
  bounded "${RUNNER_PULL_TIMEOUT_S:-900}" docker pull "$RUNNER_IMAGE" >>"$log" 2>&1
  answer=$?
  if [ "$answer" = 0 ]; then pulled=0; break; fi
  if [ "$answer" = 124 ] || [ "$answer" = 137 ]; then
    say "docker pull did not finish in ${RUNNER_PULL_TIMEOUT_S:-900} s (attempt $attempt of 5): stopped"
  else
    say "docker pull failed (attempt $attempt of 5)"
  fi
  [ $((SECONDS - pull_began)) -lt "${RUNNER_PULL_FOR_S:-1800}" ] || break
  [ "$attempt" = 5 ] || sleep $((attempt * ${RUNNER_PULL_RETRY_S:-10}))
done
if [ "$pulled" != 0 ]; then
  end_without_job 3 "cannot pull $RUNNER_IMAGE ($attempt attempts in $((SECONDS - pull_began)) s; the log above has docker's answer): ran nothing"
fi

# libtpu's lockfile (/tmp/libtpu_lockfile) lives in the container's own /tmp, which every `docker run --rm`
# starts empty: a lockfile left by a killed run goes with its container, so the host has nothing to clear.
# Root inside the container: libtpu opens the TPU devices and pins host memory for them.
container="runner-$RUNNER_NAME-$RUNNER_SUBMISSION-w$worker"
# shellcheck disable=SC2054  # docker's option value is itself a comma-separated list of labels
cloud_logging=(--log-driver=gcplogs --log-opt gcp-log-cmd=false --log-opt labels=runner-job,runner-submission)
labels=(--label "runner-job=$RUNNER_NAME" --label "runner-submission=$RUNNER_SUBMISSION")
doctor=(--rm --net=host --privileged --user 0:0 "${tpu_env[@]}" -v "$workdir:/job:ro")
doctor_args=(doctor --json --save /job/spec.yaml)
# One report in the run folder: worker 0's; another worker's goes to its own log.
[ "$worker" = 0 ] || doctor_args=(doctor --json /job/spec.yaml)
# The doctor's report is kept beside the summary; the job runs either way (a failing check names the cause
# in the log before the job meets it). It also tries Cloud Logging: docker refuses to start a container
# (exit 125) when its log driver cannot reach Cloud Logging, and then the job logs to the bucket only.
# A doctor that does not finish in RUNNER_DOCTOR_TIMEOUT_S is stopped (its container removed) and the job runs.
run_doctor() {
  bounded "${RUNNER_DOCTOR_TIMEOUT_S:-600}" docker run "${doctor[@]}" "$@" "${labels[@]}" --name "$container-doctor" \
    "$RUNNER_IMAGE" "${doctor_args[@]}" >>"$log" 2>&1
  checked=$?
  if [ "$checked" = 124 ] || [ "$checked" = 137 ]; then
    bounded 60 docker rm -f "$container-doctor" >>"$log" 2>&1 || true
    say "runner doctor did not finish in ${RUNNER_DOCTOR_TIMEOUT_S:-600} s: stopped; the job runs without its report"
  fi
}
run_doctor "${cloud_logging[@]}"
log_driver=gcplogs
if [ "$checked" = 125 ]; then
  say "docker could not start a container with the gcplogs log driver (Cloud Logging: the VM needs the logging.write scope and roles/logging.logWriter); the log goes to the bucket only"
  cloud_logging=()
  log_driver=json-file
  run_doctor
fi
[ "$checked" = 0 ] || [ "$checked" = 124 ] || [ "$checked" = 137 ] ||
  say "runner doctor reported a failing check (exit $checked); see doctor.json in the run folder"

printf '{"worker": %s, "submission": "%s", "started_at": "%s", "log_driver": "%s", "container": "%s"}\n' \
  "$worker_json" "$RUNNER_SUBMISSION" "$(stamp)" "$log_driver" "$container" >"$workdir/started.json"
bounded 120 gcloud storage cp --quiet "$workdir/started.json" "$logs/worker-$worker.started.json" >/dev/null 2>&1 || true
say "starting the job in container $container (log driver $log_driver)"
(while sleep "${RUNNER_UPLOAD_EVERY_S:-30}"; do upload; done) </dev/null >/dev/null 2>&1 &
uploader=$!
# The job's limits: it enforces them itself (saves, exits 124); `timeout` kills what is left a grace period
# after the wall-clock limit. --foreground keeps the job in this script's process group, where a VM's
# shutdown (a preemption) reaches it. TERM goes to `docker run`, which passes it on to the container; after
# RUNNER_KILL_AFTER_S more, KILL ends the client, and `docker rm -f` the container, which would outlive it.
# A preemption stops the VM: systemd stops this script (TERM to `docker run`, which passes it on) and dockerd,
# which stops each container as `docker stop` does: TERM, then KILL once the container's stop timeout has
# passed, 10 s unless `--stop-timeout` says otherwise (docker/cli docs/reference/commandline/container_run.md;
# moby's daemon waits for the longest container stop timeout at its own shutdown). RUNNER_STOP_TIMEOUT_S covers
# the job's checkpoint.grace_s and its exit after the save, so the save a notice starts is not cut short.
limits=()
outside=()
[ -z "${RUNNER_MAX_RUN_S:-}" ] || limits+=(--set "train.max_duration=$RUNNER_MAX_RUN_S")
[ -z "${RUNNER_STALL_TIMEOUT_S:-}" ] || limits+=(--set "train.stall_timeout=$RUNNER_STALL_TIMEOUT_S")
if [ -n "${RUNNER_MAX_RUN_S:-}" ]; then
  deadline_s=$((RUNNER_MAX_RUN_S + ${RUNNER_LIMIT_GRACE_S:-600}))
  outside=(timeout --foreground --signal=TERM --kill-after="${RUNNER_KILL_AFTER_S:-60}" "$deadline_s")
fi
job_began=$SECONDS
"${outside[@]}" docker run --rm --name "$container" --stop-timeout "${RUNNER_STOP_TIMEOUT_S:-60}" --net=host \
  --privileged --user 0:0 "${cloud_logging[@]}" "${labels[@]}" "${tpu_env[@]}" "${code_env[@]}" \
  -e RUNNER_WORKER="$worker" -v "$workdir:/job:ro" "$RUNNER_IMAGE" run /job/spec.yaml "${limits[@]}" >>"$log" 2>&1
code=$?
kill "$uploader" 2>/dev/null
reason="the job exited with code $code"
if [ -n "${RUNNER_MAX_RUN_S:-}" ] && [ $((SECONDS - job_began)) -ge "$deadline_s" ] && { [ "$code" = 124 ] || [ "$code" = 137 ]; }; then
  bounded 60 docker rm -f "$container" >>"$log" 2>&1 || true
  code=124
  reason="the job was killed at its wall-clock limit: still running ${RUNNER_LIMIT_GRACE_S:-600} s after --max-run-duration (${RUNNER_MAX_RUN_S} s); exit 124"
elif [ "$code" = 124 ]; then
  # A stalled job writes no summary, only its guard's mark (runner/rundir/stalled.py); a time limit writes both.
  if bounded 120 gcloud storage cat "$RUNNER_RUN_DIR/stalled.json" >/dev/null 2>&1; then
    stopped=stalled
  else
    stopped="$(bounded 120 gcloud storage cat "$RUNNER_RUN_DIR/summary.json" 2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin).get("status", ""))' 2>/dev/null)"
  fi
  reason="the job stopped itself with exit 124 (${stopped:-unknown}; time_limit: --max-run-duration, stalled: --stall-timeout); not run again"
fi
say "job exited with code $code"
record_exit "$code" true "$reason"
release "$reason"
