"""The request `runner submit` sends for a TPU VM job: a queued resource whose one node (every worker of its
slice) runs the startup script (runner/cloud/tpu_startup.sh) with this job's settings above it; the same request
as a gcloud command for `--dry-run`; and the settings read back from a queued resource (`runner status`).

The body is google-cloud-tpu's QueuedResource (imported late): the same JSON as gcloud's for the same flags.
"""

from __future__ import annotations

import base64
import dataclasses
import datetime
import json
import math
import re
import shlex
from pathlib import Path
from typing import Any

import yaml

from runner import RunnerError
from runner.cloud import pricing
from runner.cloud.durations import STARTUP_BOUNDS, parse_valid_until, valid_until_text
from runner.cloud.submit import Submission
from runner.spec.types import JobSpec

API_HOST = "https://tpu.googleapis.com"
SCOPE = "https://www.googleapis.com/auth/cloud-platform"  # the VM's scopes; Cloud Logging and Storage included
_STARTUP_BODY = Path(__file__).with_name("tpu_startup.sh")
_HEREDOC_END = "RUNNER_STARTUP_SCRIPT"


def spec_yaml(spec: JobSpec) -> str:
    # What the spec sets (overrides included), not every default: the image's runner fills those in.
    return yaml.safe_dump(json.loads(spec.model_dump_json(exclude_unset=True)), sort_keys=False)


# --- the request ---------------------------------------------------------------------------------


def startup_script(sub: Submission) -> str:
    """The job's settings as shell variables, then the fixed body (runner/cloud/tpu_startup.sh)."""
    settings = {
        "RUNNER_NAME": sub.name,
        "RUNNER_SUBMISSION": sub.submission_id,
        "RUNNER_PROJECT": sub.project,
        "RUNNER_ZONE": sub.zone,
        "RUNNER_IMAGE": sub.image,
        "RUNNER_RUN_DIR": sub.spec.run_dir,
        "RUNNER_KEEP": "1" if sub.keep else "0",
        "RUNNER_MAX_RESTARTS": str(sub.max_restarts),
        "RUNNER_TPU_TYPE": sub.tpu.name,
        # Hosts (TPU VMs) in the slice, from the TPU table: every one runs the container as one JAX process. A
        # worker the metadata server gives no number is taken as worker 0 only on a slice of one host.
        "RUNNER_HOSTS": str(sub.tpu.hosts),
        # The job's limits in seconds (empty: none), passed to `runner run` and enforced from outside too.
        "RUNNER_MAX_RUN_S": "" if sub.max_run_s is None else str(sub.max_run_s),
        "RUNNER_STALL_TIMEOUT_S": "" if sub.stall_timeout_s is None else str(sub.stall_timeout_s),
        # docker's stop timeout for the job's container (dockerd's default, 10 s, would cut a preemption's save
        # short): the job's checkpoint.grace_s, and 30 s for its summary and exit after the save.
        "RUNNER_STOP_TIMEOUT_S": str(math.ceil(sub.spec.checkpoint.grace_s) + 30),
        "RUNNER_TPU_RUNTIME_VERSION": sub.runtime_version,  # recorded by tpus.device_facts
        "RUNNER_SPOT": "true" if sub.spot else "false",
        "RUNNER_USD_PER_CHIP_HOUR": json.dumps(pricing.price_per_chip_hour(sub.tpu.name, sub.zone, sub.spot).usd),
        # The startup script skips a job whose summary is complete for these epochs (none for a benchmark).
        "RUNNER_EPOCHS": str(sub.spec.train.epochs) if sub.spec.kind == "train" else "",
        "RUNNER_SPEC_B64": base64.b64encode(spec_yaml(sub.spec).encode()).decode(),
    }
    if sub.code_ref:  # the code sent with the job: the container's `runner run` fetches it (runner/cloud/codefetch.py)
        settings["RUNNER_CODE"] = sub.code_ref
    header = ["#!/bin/bash", f"# runner job {sub.spec.name!r}: written by `runner submit`"]
    for key, value in settings.items():
        if key == "RUNNER_MAX_RESTARTS":  # read back from the script by `runner watch`, not by the script
            header.append("# shellcheck disable=SC2034")
        header.append(f"{key}={shlex.quote(value)}")
    # The bounds `submit`'s "at most" adds up (runner/cloud/durations.py), unless the VM's environment sets one.
    header += [f': "${{{key}:={value}}}"' for key, value in STARTUP_BOUNDS.items()]
    return "\n".join(header) + "\n" + _STARTUP_BODY.read_text()


def settings_of(script: str) -> dict[str, str]:
    """The RUNNER_* settings at the top of a startup script (how `status` finds a job's run folder)."""
    found = {}
    for line in script.splitlines():
        if re.match(r"RUNNER_[A-Z_0-9]+=", line):
            key, _, value = line.partition("=")
            found[key] = " ".join(shlex.split(value))
    return found


def build_request(sub: Submission):
    """The QueuedResource to create: one node, this job's startup script and labels, the chosen network,
    service account, reservation and valid-until bound."""
    from google.cloud import tpu_v2

    # gcloud sends enableExternalIps: true unless --internal-ips (then the field is left out: false).
    network = tpu_v2.NetworkConfig(network=sub.network or "default", enable_external_ips=not sub.internal_ips)
    if sub.subnetwork:
        network.subnetwork = sub.subnetwork
    account = tpu_v2.ServiceAccount(scope=[SCOPE])
    if sub.service_account:
        account.email = sub.service_account
    node = tpu_v2.Node(
        accelerator_type=sub.tpu.name,
        runtime_version=sub.runtime_version,
        network_config=network,
        service_account=account,
        metadata={"startup-script": startup_script(sub)},
        labels=sub.labels,
    )
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=sub.parent, node_id=sub.name, node=node)
    request = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
    if sub.spot:
        request.spot = tpu_v2.QueuedResource.Spot()
    if sub.reservation:
        # What `gcloud ... --reservation-host-project` (and --reserved, for the job's own project) sends.
        request.reservation_name = f"projects/{sub.reservation}/locations/{sub.zone}/reservations/-"
    if sub.valid_until:  # a time as its instant: the body carries gcloud's text for it (request_json)
        kind, value = parse_valid_until(sub.valid_until)
        policy = ({"valid_until_duration": datetime.timedelta(seconds=value)} if kind == "duration"
                  else {"valid_until_time": value})
        request.queueing_policy = tpu_v2.QueuedResource.QueueingPolicy(**policy)
    return request


def request_json(sub: Submission) -> dict[str, Any]:
    """The body `submit` POSTs (build_request's JSON, enums as integers), validUntilTime as gcloud sends it."""
    from google.cloud import tpu_v2

    body = json.loads(tpu_v2.QueuedResource.to_json(build_request(sub), always_print_fields_with_no_presence=False))
    for spec in body["tpu"]["nodeSpec"]:  # proto maps come out in no fixed order: the same request, the same bytes
        for key in ("labels", "metadata"):
            if key in spec["node"]:
                spec["node"][key] = dict(sorted(spec["node"][key].items()))
    if "validUntilTime" in body.get("queueingPolicy", {}):
        body["queueingPolicy"]["validUntilTime"] = valid_until_text(str(sub.valid_until))
    return body


# A dry run without --submission-id prints a script that makes its submission id when it runs (as `runner
# submit` does when it sends): the same inputs print the same bytes, and each run of the script is a submission
# of its own (a startup script skips a submission that already ran on its worker).
_MADE_AT_RUN = "00000000-000000-0000"  # the id's shape (record.new_submission_id), never sent
_PLACEHOLDER = "@@RUNNER_SUBMISSION@"  # in the startup script until the script runs; 20 characters, as an id
_SUBMISSION_LINE = ('submission="$(date -u +%Y%m%d-%H%M%S)-$(od -An -N2 -tx1 /dev/urandom | tr -d \' \\n\')"'
                    "  # this submission's id (runner submit --submission-id names one)")


def gcloud_script(sub: Submission) -> str:
    """A bash script that sends the same create request with gcloud; watch/logs/cancel as comments. Without
    --submission-id the script makes its own id when it runs."""
    if sub.submission_named:
        return _gcloud_script(sub)
    text = _gcloud_script(dataclasses.replace(sub, submission_id=_MADE_AT_RUN))
    head, _, rest = text.partition(f"<<'{_HEREDOC_END}'\n")
    body, _, tail = rest.partition(f"\n{_HEREDOC_END}\n")
    head = head.replace(_MADE_AT_RUN, "(made when the script runs)").replace(
        "set -euo pipefail\n", f"set -euo pipefail\n{_SUBMISSION_LINE}\n", 1)
    body = body.replace(_MADE_AT_RUN, _PLACEHOLDER)  # as long as an id: the script's size said above holds
    lines = []
    for line in tail.split("\n"):
        if _MADE_AT_RUN in line:  # the --labels flag: quoted, as a flag holding a variable is
            flag, slash = (line[:-2], " \\") if line.endswith(" \\") else (line, "")
            indent = flag[: len(flag) - len(flag.lstrip())]
            line = f'{indent}"{flag.strip().replace(_MADE_AT_RUN, "$submission")}"{slash}'
        lines.append(line)
    return (f"{head}<<'{_HEREDOC_END}'\n{body}\n{_HEREDOC_END}\n"
            f'sed -i "s/{_PLACEHOLDER}/$submission/g" "$startup"\n' + "\n".join(lines))


def _gcloud_script(sub: Submission) -> str:
    script = startup_script(sub)
    if f"\n{_HEREDOC_END}\n" in f"\n{script}":
        raise RunnerError(f"the startup script contains the line {_HEREDOC_END}; it cannot be quoted in a heredoc")
    shown = request_json(sub)
    node = shown["tpu"]["nodeSpec"][0]["node"]
    node["metadata"]["startup-script"] = f"<the startup script below, {len(script.encode())} bytes>"
    where = f"--project={sub.project} --zone={sub.zone}"
    valid = []
    if sub.valid_until:
        kind, _ = parse_valid_until(sub.valid_until)
        valid = [f"--valid-until-{kind}={valid_until_text(sub.valid_until)}"]
    flags = [
        f"gcloud compute tpus queued-resources create {sub.name} {where}",
        f"--node-id={sub.name}",
        f"--accelerator-type={sub.tpu.name}",
        f"--runtime-version={sub.runtime_version}",
        *(["--spot"] if sub.spot else []),
        *([f"--network={sub.network}"] if sub.network else []),
        *([f"--subnetwork={sub.subnetwork}"] if sub.subnetwork else []),
        *([f"--service-account={sub.service_account}"] if sub.service_account else []),
        *(["--internal-ips"] if sub.internal_ips else []),
        *([f"--reservation-host-project={sub.reservation}"] if sub.reservation else []),
        *valid,
        '--metadata-from-file="startup-script=$startup"',
        "--labels=" + ",".join(f"{k}={v}" for k, v in sorted(sub.labels.items())),
        f"--scopes={SCOPE}",
        "--async",
    ]
    code = [] if not sub.code_ref else [
        f"# The job's code: {sub.code_ref.partition('#')[0]}, which `runner submit` (without --dry-run) uploads",
        "# before its request; this script uploads nothing, so the job finds its code only if it is there.",
    ]
    lines = [
        "#!/bin/bash",
        f"# Job {sub.spec.name!r} on a {sub.tpu.name} in {sub.zone}: this script sends, with gcloud, the request",
        f"# `runner submit` sends to POST {API_HOST}/v2/{sub.parent}/queuedResources?queuedResourceId={sub.name}",
        *code,
        *("#   " + line for line in json.dumps(shown, indent=2).splitlines()),
        "set -euo pipefail",
        'startup="$(mktemp)"',
        "trap 'rm -f \"$startup\"' EXIT",
        f"cat >\"$startup\" <<'{_HEREDOC_END}'",
        script.rstrip("\n"),
        _HEREDOC_END,
        " \\\n  ".join(flags),
        f"# Watch:   gcloud compute tpus queued-resources describe {sub.name} {where}",
        f"# Logs:    runner logs {sub.name}     (summary and cost: add --summary)",
        f"# Cancel:  gcloud compute tpus queued-resources delete {sub.name} {where} --force --quiet",
        "# (without `runner submit`, no RUN_DIR/job.json is written: `runner watch` rebuilds it from the queued "
        "resource)",
    ]
    return "\n".join(lines) + "\n"
