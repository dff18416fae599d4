"""The job on GKE: the JobSet that xpk creates for a TPU type (`xpk workload create`), or the `xpk workload
create` command line itself (--format xpk). Applied with the kubernetes Python client when not --dry-run
(`pip install 'tpu-job-runner[gke]'`; the cluster is kubeconfig's current context).

The manifest follows xpk's (xpk/commands/workload.py, WORKLOAD_CREATE_YAML): one replicated job `slice-job`
with one replica per slice and one pod per host, `backoffLimit: 0`, and failure rules in two layers:
  - the Job's pod failure policy (Kubernetes batch/v1, first matching rule wins): a pod with the
    DisruptionTarget condition (preempted, evicted, its node drained or shut down) is `Ignore`d: the Job
    makes a new pod and nothing is counted; an exit code outside RESTART_CODES (1, 2: failed training, bad
    spec or data; 124: a time limit reached) is `FailJob`; any other exit (75 preempted, 3 infrastructure,
    signals) counts against backoffLimit 0, so the Job fails with BackoffLimitExceeded;
  - the Job's deadline, `activeDeadlineSeconds` (batch/v1 JobSpec: "the duration in seconds relative to the
    startTime that the job may be continuously active before the system tries to terminate it"; a Job
    suspended, as Kueue admits it, has that timer "stopped and reset when the Job is resumed"): the
    --max-run-duration plus LIMIT_GRACE_S, after the job's own limit has had time to save and exit 124. It
    counts from the Job's start, so time a pod waits for a TPU node is inside it (docs/engines.md);
  - the JobSet's failure policy (JobSet's FailurePolicyRule, jobset.x-k8s.io/v1alpha2): a Job failed by the
    pod failure policy (reason PodFailurePolicy) or its deadline (DeadlineExceeded) fails the JobSet at once
    (FailJobSet), so neither exit 124 nor the deadline starts the clock again; any other Job failure gets
    JobSet's default action, RestartJobSet, counted against `maxRestarts` (--max-restarts; default
    DEFAULT_RESTARTS with or without --spot: an on-demand node is drained for upgrades and maintenance too).
    Each restart makes new Jobs, each with the whole deadline again, as a TPU VM's restart runs the limit again.
xpk has no deadline flag (xpk 1.16.0 `workload create`): with --format xpk the job's own limit is the only one.
The rule fields are the ones JobSet's own API declares (onJobFailureReasons; onJobFailureMessagePatterns only
exists from JobSet v0.11, and xpk installs v0.10.1, so it is not used).

The pod runs as root, privileged and on the host network, as on a TPU VM (libtpu opens the TPU devices).
GKE Autopilot refuses such pods, and so does a namespace that enforces the baseline or restricted Pod
Security Standard: `preflight` checks both before anything is created, so this runs on GKE Standard
clusters with TPU node pools.

GKE names a node's TPU by accelerator and topology; HOSTS is read from the TPU table (runner/device/tpus.json:
GKE's "Plan TPUs in GKE" page, xpk's system characteristics for TPU7x, tpu7x-8 a 2x2x1 host of 4 chips,
tpu7x-standard-4t, and for the multi-host slices, e.g. v6e-16: topology 4x4, 4 nodes of 4 chips, ct6e-standard-4t,
with Google's own table as the source). v5litepod-8 and v6e-8 have a 2x4 topology both as one 8-chip host and
as two 4-chip hosts (xpk's catalog makes the latter), so every pod also selects its machine type
(`node.kubernetes.io/instance-type`, Kubernetes's well-known label): it lands on a node pool of that type or
nowhere, and NODE_POOL says how to make a one-host one. --format xpk is refused for those two types.

A multi-host slice is one Job of one pod per host, as xpk makes it: `parallelism` and `completions` the slice's
hosts, all pods on one node pool (the exclusive-topology annotation; JobSet's "TPU Multislice Training" page),
and `network.enableDNSHostnames`, the headless service that gives each pod a DNS name
(NAME-slice-job-0-INDEX.NAME; JobSet's Network type, api/jobset/v1alpha2/jobset_types.go). JobSet's webhook
sets both that and `completionMode: Indexed` when they are missing (pkg/webhooks/jobset_webhook.go, Default);
the first is written here so that the manifest says it. GKE's TPU webhook gives each pod TPU_WORKER_ID and
TPU_WORKER_HOSTNAMES, from which `jax.distributed.initialize()` finds the slice (jax
`jax/_src/clusters/cloud_tpu_cluster.py`, GkeTpuCluster). One pod failing fails the Job (backoffLimit 0), and
the JobSet's restart makes the whole slice again: JAX's processes share fate (docs/fault_tolerance.rst).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from typing import Any

from runner import AcceleratorError, SpecError
from runner.cloud.engines import (
    CONTAINER,
    RETRY_BOUNDED,
    Options,
    command,
    container_env,
    deadline_s,
    dump_yaml,
)
from runner.cloud.submit import DEFAULT_SPOT_RESTARTS, Submission
from runner.device import tpus

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
# xpk restarts on these unless told otherwise (`xpk workload create --help`, --restart-on-exit-codes).
XPK_RESTART_CODES = (42, *range(127, 256))
RESTART_CODES = tuple(sorted({*XPK_RESTART_CODES, *RETRY_BOUNDED}))
XPK_QUEUE = "multislice-queue"  # the LocalQueue xpk labels every workload with
NAME_LIMIT = 40  # xpk's limit for a workload: pod names add "-slice-job-0-0-" and a suffix within 63
# The machine types xpk's catalog runs two containers on, each with half the host's chips (SystemCharacteristics
# parallel_containers=2: tpu7-standard-4t, tpu7x-standard-4t). xpk 1.9.0 to 1.13.1 do so by default
# (`--use-parallel-containers`, argparse.BooleanOptionalAction, default True: xpk/parser/workload.py), xpk 1.16.0
# only when asked; `--no-use-parallel-containers` turns it off in every xpk since 1.9.0 (xpk PR #1136).
XPK_PARALLEL_CONTAINERS = frozenset({"tpu7-standard-4t", "tpu7x-standard-4t"})
TTL_SECONDS = 12 * 3600  # xpk's default: a finished JobSet is deleted after 12 hours
DEFAULT_RESTARTS = DEFAULT_SPOT_RESTARTS  # JobSet restarts after exit 3, 75 or a signal, --spot or not
INSTANCE_TYPE = "node.kubernetes.io/instance-type"
# GKE Autopilot's own mutating webhooks, by name: their presence is how Agones (agones-dev/agones,
# pkg/cloudproduct/gke/gke.go, Detect) tells Autopilot from Standard; the first is the name before GKE 1.26.
AUTOPILOT_WEBHOOKS = ("workload-defaulter.config.common-webhooks.networking.gke.io",
                      "sasecret-redacter.config.common-webhooks.networking.gke.io")
POD_SECURITY = "pod-security.kubernetes.io/enforce"  # the namespace label of Kubernetes Pod Security Admission
# GKE's command for a TPU node pool (https://cloud.google.com/kubernetes-engine/docs/how-to/tpus, "Create a
# single-host TPU slice node pool"; a multi-host one adds --tpu-topology, "Create a multi-host TPU slice node pool").
NODE_POOL = ("gcloud container node-pools create NAME --cluster CLUSTER --location LOCATION "
             "--node-locations {zone} --machine-type {machine}{topology} --num-nodes {hosts}{spot}")
INSTALL = "pip install 'tpu-job-runner[gke]'   (or: pip install kubernetes)"
# JobSet's installation page (kubernetes-sigs/jobset site/content/en/docs/installation/_index.md) installs a release
# with this command; v0.10.1 is the release xpk installs (above).
JOBSET_RELEASE = "v0.10.1"
JOBSET_INSTALL = ("kubectl apply --server-side -f https://github.com/kubernetes-sigs/jobset/releases/download/"
                  f"{JOBSET_RELEASE}/manifests.yaml")


@dataclasses.dataclass(frozen=True)
class Host:
    accelerator: str  # cloud.google.com/gke-tpu-accelerator
    topology: str  # cloud.google.com/gke-tpu-topology
    machine_type: str
    chips: int  # google.com/tpu per host (per pod)
    xpk_hosts: int  # how many hosts xpk's catalog gives the same type name
    source: str  # the table's source for this host


HOSTS = {
    name: Host(generation.row["gke"]["accelerator"], h["topology"], h["machine_type"], h["chips"], h["xpk_hosts"],
               tpus.source(h.get("source", generation.row["gke"]["source"])))
    for generation in tpus.generations().values()
    for name, h in generation.row["gke"].get("hosts", {}).items()
}


def host_of(sub: Submission) -> Host:
    host = HOSTS.get(sub.tpu.name)
    if host is None:
        why = sub.tpu.facts.refusal("gke") or "none in runner/device/tpus.json"
        raise SpecError(f"--tpu-type {sub.tpu.name} has no GKE node type ({why}); types on GKE: {', '.join(HOSTS)}")
    return host


def max_restarts(sub: Submission, options: Options) -> int:
    """--max-restarts if given, else DEFAULT_RESTARTS. Without Options.max_restarts (a caller that does not
    pass the flag through) a nonzero count on the Submission is taken as given."""
    if options.max_restarts is not None:
        return options.max_restarts
    return sub.max_restarts or DEFAULT_RESTARTS


def node_pool_command(sub: Submission, host: Host) -> str:
    topology = f" --tpu-topology {host.topology}" if sub.tpu.hosts > 1 else ""
    return NODE_POOL.format(zone=sub.zone, machine=host.machine_type, topology=topology, hosts=sub.tpu.hosts,
                            spot=" --spot" if sub.spot else "")


def check_name(name: str) -> str:
    if len(name) > NAME_LIMIT:
        raise SpecError(f"--name {name!r} is {len(name)} characters; a JobSet's pods need it within {NAME_LIMIT} "
                        f"(xpk's limit): give a shorter --name, e.g. {name[:NAME_LIMIT].rstrip('-')}")
    return name


def pod_template(sub: Submission, host: Host) -> dict[str, Any]:
    """The pod xpk's template makes, for the runner image (no xpk priority class or pull secret: a cluster
    without them would refuse the pod)."""
    chips = {"google.com/tpu": host.chips}
    selector = {"cloud.google.com/gke-tpu-accelerator": host.accelerator,
                "cloud.google.com/gke-tpu-topology": host.topology,
                INSTANCE_TYPE: host.machine_type}
    if sub.spot:
        selector["cloud.google.com/gke-spot"] = "true"
    return {
        "metadata": {"labels": {"runner-job": sub.name}},
        "spec": {
            "restartPolicy": "Never",
            "nodeSelector": selector,
            "hostNetwork": True,
            "dnsPolicy": "ClusterFirstWithHostNet",
            "terminationGracePeriodSeconds": 30,
            "tolerations": [{"key": "google.com/tpu", "operator": "Exists"}],
            "containers": [{
                "name": CONTAINER,
                "image": sub.image,
                "command": ["bash", "-c", command(sub)],
                "env": [{"name": key, "value": value} for key, value in container_env(sub).items()],
                # Root and privileged, as on a TPU VM (runner/cloud/tpu_startup.sh): libtpu opens the TPU
                # devices; the image's own user is uid 1000.
                "securityContext": {"privileged": True, "runAsUser": 0},
                "resources": {"limits": chips, "requests": chips},
            }],
        },
    }


def jobset(sub: Submission, options: Options) -> dict[str, Any]:
    """The JobSet for one slice: one pod per host."""
    host = host_of(sub)
    hosts = sub.tpu.hosts
    deadline = deadline_s(sub)
    labels = {"runner-job": check_name(sub.name)}
    if options.queue:
        labels["kueue.x-k8s.io/queue-name"] = options.queue
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "JobSet",
        "metadata": {
            "name": sub.name,
            "namespace": options.namespace,
            "labels": labels,
            # One slice per node pool, as xpk asks.
            "annotations": {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"},
        },
        "spec": {
            "ttlSecondsAfterFinished": TTL_SECONDS,
            "failurePolicy": {
                "maxRestarts": max_restarts(sub, options),
                "rules": [{"name": "FailOnNonRetryableExit", "action": "FailJobSet",
                           "onJobFailureReasons": ["PodFailurePolicy"]},
                          {"name": "FailAtTimeLimit", "action": "FailJobSet",
                           "onJobFailureReasons": ["DeadlineExceeded"]}],
            },
            "replicatedJobs": [{
                "name": "slice-job",
                "replicas": 1,
                "template": {"spec": {
                    "parallelism": hosts,
                    "completions": hosts,
                    "backoffLimit": 0,
                    **({} if deadline is None else {"activeDeadlineSeconds": deadline}),
                    "podFailurePolicy": {"rules": [
                        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                        {"action": "FailJob", "onPodConditions": [],
                         "onExitCodes": {"containerName": CONTAINER, "operator": "NotIn",
                                         "values": list(RESTART_CODES)}},
                    ]},
                    "template": pod_template(sub, host),
                }},
            }],
            # The headless service of the pods' DNS names (JobSet's default, said here): a slice's hosts find each
            # other through it.
            **({"network": {"enableDNSHostnames": True}} if hosts > 1 else {}),
        },
    }


def manifest_yaml(doc: dict[str, Any]) -> str:
    name = doc["metadata"]["name"]
    header = [
        f"# JobSet for runner job {name!r}: kubectl apply -f THIS_FILE (JobSet and, for the queue label, Kueue",
        "# installed; a GKE Standard cluster: the pod is privileged). A disrupted pod (preemption, drain) is",
        "# replaced; exit 75 and 3 restart the JobSet up to failurePolicy.maxRestarts; 1, 2 and 124 (a time",
        "# limit) end it, as does activeDeadlineSeconds. The spec is base64 in RUNNER_SPEC_B64.",
    ]
    return "\n".join(header) + "\n" + dump_yaml(doc)


def xpk_command(sub: Submission, options: Options) -> str:
    """`xpk workload create` for the same job. xpk makes its own manifest, with these differences: its
    container is not run as root (xpk has no flag for it) and its priority class is xpk's `medium`. On TPU7x it
    runs one container per host (--no-use-parallel-containers, XPK_PARALLEL_CONTAINERS)."""
    host = host_of(sub)
    if host.xpk_hosts != sub.tpu.hosts:
        why = ("is not in xpk's catalog" if host.xpk_hosts == 0 else
               f"is {host.xpk_hosts} hosts of {sub.tpu.chips // host.xpk_hosts} chips in xpk's catalog")
        same = [name for name, h in HOSTS.items() if h.xpk_hosts == tpus.parse_tpu_type(name).hosts]
        raise SpecError(f"--format xpk: {sub.tpu.name} {why}, and this runner runs it as {sub.tpu.hosts} host(s) of "
                        f"{host.chips} chips; use the JobSet manifest (--format manifest: {host.machine_type} hosts; "
                        f"node pool: {node_pool_command(sub, host)}) or a type xpk runs as this runner does: "
                        f"{', '.join(same)}")
    if not options.cluster:
        raise SpecError("--format xpk needs --cluster: the GKE cluster xpk created (xpk cluster create)")
    if options.queue and options.queue != XPK_QUEUE:
        raise SpecError(f"--format xpk --queue {options.queue}: xpk submits to its own LocalQueue {XPK_QUEUE!r} and "
                        "has no flag for another; drop --queue, or use --format manifest")
    words = [
        "xpk", "workload", "create",
        "--cluster", options.cluster, "--project", sub.project, "--zone", sub.zone,
        "--workload", check_name(sub.name),
        "--docker-image", sub.image, "--docker-name", CONTAINER,
        "--tpu-type", sub.tpu.name, "--num-slices", "1",
        "--command", command(sub),
        "--max-restarts", str(max_restarts(sub, options)),
        "--restart-on-exit-codes", ",".join(map(str, RETRY_BOUNDED)),
        *(["--spot"] if sub.spot else []),
        *(["--namespace", options.namespace] if options.namespace != "default" else []),
        # One container of all the host's chips, one `runner run` per host (one JAX process each).
        *(["--no-use-parallel-containers"] if host.machine_type in XPK_PARALLEL_CONTAINERS else []),
    ]
    for key, value in container_env(sub).items():
        words += ["--env", f"{key}={value}"]
    return shlex.join(words)


def preflight(api_client: Any, namespace: str) -> None:
    """Refuses a cluster that would refuse the pod (root, privileged, host network): GKE Autopilot, or a
    namespace that enforces the baseline or restricted Pod Security Standard. Anything else it cannot read
    (no permission to list webhooks, say) is left for the API server to judge."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    admission = client.AdmissionregistrationV1Api(api_client)
    for webhook in AUTOPILOT_WEBHOOKS:
        try:
            admission.read_mutating_webhook_configuration(webhook, _request_timeout=30)
        except ApiException:
            continue
        raise SpecError(f"the cluster is GKE Autopilot (it has the mutating webhook {webhook}); Autopilot refuses "
                        "privileged pods on the host network, which the runner's TPU pod is: use a GKE Standard "
                        "cluster with a TPU node pool (docs/engines.md)")
    try:
        labels = client.CoreV1Api(api_client).read_namespace(namespace, _request_timeout=30).metadata.labels or {}
    except ApiException:
        return
    level = labels.get(POD_SECURITY)
    if level in ("baseline", "restricted"):
        raise SpecError(f"namespace {namespace!r} enforces the {level!r} Pod Security Standard ({POD_SECURITY}="
                        f"{level}), which refuses a privileged pod on the host network: give a namespace whose "
                        f"{POD_SECURITY} is privileged or unset (--namespace)")


def apply(sub: Submission, manifest: dict[str, Any]) -> dict[str, Any]:
    """Creates the JobSet in kubeconfig's current cluster (KUBECONFIG honoured)."""
    try:
        from kubernetes import client, config
        from kubernetes.client.rest import ApiException
    except ImportError:
        raise SpecError(f"the kubernetes client is not installed: {INSTALL}; or print the manifest with --dry-run "
                        "and `kubectl apply -f` it") from None
    name, namespace = manifest["metadata"]["name"], manifest["metadata"]["namespace"]
    try:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # now, not when the client was imported
    except Exception as exc:  # no kubeconfig, or no current context
        raise AcceleratorError(f"no Kubernetes cluster to send JobSet {name!r} to: {exc}; run `gcloud container "
                               f"clusters get-credentials CLUSTER --location LOCATION --project {sub.project}` "
                               "(or set KUBECONFIG)") from exc
    try:
        preflight(client.ApiClient(), namespace)
    except SpecError:
        raise
    except Exception as exc:
        raise AcceleratorError(f"could not reach the cluster to check it before creating JobSet {name!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
    api = client.CustomObjectsApi()
    try:
        created = api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest, _request_timeout=60)
    except ApiException as exc:
        if exc.status == 409:
            raise SpecError(f"a JobSet {name!r} already exists in namespace {namespace!r}: delete it "
                            f"(`kubectl delete jobset {name} -n {namespace}`) or give another --name "
                            f"(e.g. --name {name}-2)") from None
        if exc.status == 404:
            raise AcceleratorError(f"the cluster has no JobSet API ({GROUP}/{VERSION}): install JobSet "
                                   f"(`{JOBSET_INSTALL}`; xpk cluster create does) before submitting") from None
        raise AcceleratorError(f"the cluster refused JobSet {name!r}: {exc.status} {exc.reason}: {exc.body}") from None
    except Exception as exc:
        raise AcceleratorError(f"could not reach the cluster to create JobSet {name!r}: "
                               f"{type(exc).__name__}: {exc}") from exc
    meta = created.get("metadata", {})
    return {
        "on": "gke",
        "name": name,
        "namespace": namespace,
        "uid": meta.get("uid"),
        "run_dir": sub.spec.run_dir,
        "follow": f"kubectl get jobset {name} -n {namespace}; kubectl logs -n {namespace} -l runner-job={name} -f",
    }
