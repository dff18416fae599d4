"""Buckets: gs:// paths, credentials, bounded retries, and parallel uploads with google-cloud-storage.

Two clients touch GCS. TensorFlow's own gs:// filesystem (tf.io.gfile, tf.data, checkpoints) does the job's
reads and writes; it retries on its own, configured only through environment variables read when
TensorFlow is imported, so `configure_tensorflow` sets them from `storage.timeout_s` first. Its retries
are internal (logged at VLOG 1 only), so a run's summary cannot count them. google-cloud-storage does
`runner prepare --out gs://...` uploads: parallel, retried, counted, and bounded by the same timeout.

Reads: TensorFlow fetches a gs:// file in ranged requests of GCS_READ_CACHE_BLOCK_SIZE_MB (64 by default),
and training reopens every shard each epoch. Its CPU cost grew with the block size even for shards smaller
than one block: over MNIST's 8 MB shards the training input pipeline spent 3.3 CPU-seconds per 250 MB with
64 MB blocks, 2.25 with 8 MB, and 1.9 reading local files (benchmarks/RESULTS.md, gcs_read). The
runner sets 8 MB unless the environment already names a size: a 200 MB shard then takes 25 requests, and
the interleaved shards keep several requests in flight.

Credentials: Application Default Credentials (the VM's service account on a TPU VM, or
`gcloud auth application-default login`); anonymous when STORAGE_EMULATOR_HOST names an emulator.
Nothing here prints or records a credential or token: messages name buckets and objects only.
This module imports neither TensorFlow nor google-cloud-storage at import time.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import http.client
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable

from runner import StorageError

log = logging.getLogger(__name__)

GCS_PREFIX = "gs://"
DEFAULT_TIMEOUT_S = 300.0
_TRANSIENT_STATUS = (408, 429, 500, 502, 503, 504)


def is_gcs(path: str) -> bool:
    return path.startswith(GCS_PREFIX)


def split_gcs(url: str) -> tuple[str, str]:
    """gs://bucket/a/b -> ("bucket", "a/b")."""
    if not is_gcs(url):
        raise ValueError(f"{url!r} is not a gs:// URL")
    bucket, _, name = url[len(GCS_PREFIX):].partition("/")
    if not bucket:
        raise StorageError(f"{url!r} names no bucket; write gs://BUCKET/PREFIX")
    return bucket, name


def buckets_in(*paths: str | None) -> list[str]:
    return sorted({split_gcs(p)[0] for p in paths if p and is_gcs(p)})


# --- TensorFlow's gs:// client ------------------------------------------------------------------


# TensorFlow's gs:// read block and buffer per open file, in MB (see the module docstring).
READ_BLOCK_MB = 8


def tensorflow_env(timeout_s: float) -> dict[str, str]:
    """The GCS_* variables that make one unanswered TensorFlow gs:// operation give up after about timeout_s,
    and its read block size.

    TensorFlow waits min(init << n, max) + up to 1 s of jitter before retry n, so the retry count is
    chosen to make those waits add up to timeout_s; a stalled transfer is abandoned after the idle timeout.
    """
    init = min(1.0, timeout_s / 8)
    longest = min(32.0, max(init, timeout_s / 4))
    waited, retries = 0.0, 0
    while waited < timeout_s:
        waited += min(init * 2**retries, longest)
        retries += 1
    idle = int(min(60, max(2, timeout_s / 4)))
    return {
        "GCS_READ_CACHE_BLOCK_SIZE_MB": str(READ_BLOCK_MB),
        "GCS_RETRY_CONFIG_INIT_DELAY_TIME_US": str(int(init * 1e6)),
        "GCS_RETRY_CONFIG_MAX_DELAY_TIME_US": str(int(longest * 1e6)),
        "GCS_RETRY_CONFIG_MAX_RETRIES": str(retries),
        "GCS_REQUEST_CONNECTION_TIMEOUT_SECS": str(idle),
        "GCS_REQUEST_IDLE_TIMEOUT_SECS": str(idle),
    }


def configure_tensorflow(timeout_s: float) -> None:
    """Sets the variables of `tensorflow_env`; a value already in the environment is the user's and is kept."""
    if "tensorflow" in sys.modules:
        log.warning("TensorFlow is already imported: storage.timeout_s does not bound its gs:// client here")
    for name, value in tensorflow_env(timeout_s).items():
        os.environ.setdefault(name, value)


# A disk or folder that refuses a write, as the OS words it (OSError.strerror, and TensorFlow's C++ filesystem
# quotes the same text), with what to do about it.
_LOCAL_FAULTS = {
    errno.ENOSPC: "free space on that disk, or set output.dir to another",
    errno.EDQUOT: "free space within the quota, or set output.dir to another disk",
    errno.EROFS: "make it writable, or set output.dir to a folder this machine can write",
    errno.EACCES: "give this user write access, or set output.dir to a folder this machine can write",
    errno.ENOTDIR: "a file stands where a folder is needed: move that file away",
}


def storage_error(exc: BaseException, paths: Iterable[str | None], timeout_s: float,
                  setting: str = "storage.timeout_s") -> StorageError | None:
    """A StorageError naming the bucket when `exc` is TensorFlow giving up on GCS, or naming the path when a
    disk refused a write (full, read-only, a file where a folder belongs); None for other errors. It says nothing
    of checkpoints: the run's closing line says what the attempt kept (runner/train/progress.py), this cannot."""
    message = str(getattr(exc, "message", exc))
    kind = type(exc).__name__
    # TensorFlow's GCS client gives up with "All N retry attempts failed" (tsl's retrying_utils); an op that
    # meets it mid-way re-raises that text inside its own error type (MergeV2Checkpoints: InvalidArgumentError).
    retried_out = "retry attempts failed" in message
    # curl could not resolve or reach the storage host (libcurl codes 5, 6, 7): the network, not the data.
    unreachable = re.search(r"[Cc]ould(n't| not) (resolve|connect)|libcurl code [567]\b", message)
    if unreachable and not retried_out:
        buckets = sorted(set(re.findall(r"gs://([a-z0-9][a-z0-9._-]*)", message))) or buckets_in(*paths)
        where = ", ".join(f"gs://{b}" for b in buckets) or "the storage host"
        return StorageError(
            f"storage unreachable: {where} cannot be reached from this machine ({unreachable.group(0)}: DNS or "
            "network); check the network, a proxy (https_proxy) or the bucket's name, then run the same job again"
        )
    if not (retried_out or kind in ("UnavailableError", "DeadlineExceededError")):
        return _gcs_no_folder(message, paths, timeout_s, setting) or _local_fault(exc, message)
    named = re.findall(r"gs://([a-z0-9][a-z0-9._-]*)", message)
    buckets = sorted(set(named)) or buckets_in(*paths)
    where = ", ".join(f"gs://{b}" for b in buckets) or "the bucket"
    first_line = message.splitlines()[0][:300] if message else kind
    return StorageError(
        f"storage unreachable: {where} did not answer within {setting} ({timeout_s:g} s): {first_line}; "
        "run the same job again when the bucket answers"
    )


def _gcs_no_folder(message: str, paths: Iterable[str | None], timeout_s: float, setting: str) -> StorageError | None:
    """TensorFlow's gs:// client, asked whether a folder of a bucket exists while the bucket does not answer,
    says "/runs/job/checkpoints is not a directory" (no bucket in the path): that is the outage, not a file in
    the way, unless an object of that name really stands there. Only for a path under one of the job's gs://
    paths that is no local file."""
    found = re.search(r"(\S+) is not a directory", message)
    if found is None:
        return None
    reported = found.group(1).strip("'\":;,")
    if not reported.startswith(GCS_PREFIX) and os.path.lexists(reported):
        return None  # a real local path: _local_fault says which file is in the way
    gcs = [p for p in paths if p and is_gcs(p)]
    name = reported[len(GCS_PREFIX):].partition("/")[2] if reported.startswith(GCS_PREFIX) else reported.lstrip("/")
    under = [p for p in gcs if name.startswith(split_gcs(p)[1].strip("/"))]
    if not under:
        return None
    bucket = split_gcs(under[0])[0]
    return StorageError(
        f"storage unreachable: gs://{bucket} did not answer within {setting} ({timeout_s:g} s): TensorFlow's "
        f"gs:// client found no folder gs://{bucket}/{name}; run the same job again "
        f"when the bucket answers (should an object named gs://{bucket}/{name} stand where that folder belongs, "
        "delete it first)"
    )


def _local_fault(exc: BaseException, message: str) -> StorageError | None:
    code = getattr(exc, "errno", None)
    if code not in _LOCAL_FAULTS:  # TensorFlow's errors and h5py's carry only the text
        code = next((c for c in _LOCAL_FAULTS if os.strerror(c) in message), None)
        if code is None and " is not a directory" in message:
            code = errno.ENOTDIR
    if code is None:
        return None
    path = getattr(exc, "filename", None)
    if not path:  # "{{function_node ...}} /run/checkpoints/ckpt-32_temp/part-...tempstate123; No space left on device"
        found = re.search(r"(gs://[^\s;,'\"]+|/[^\s;,'\"]+)", re.sub(r"\{\{.*?\}\}", "", message))
        path = found.group(1) if found else "the run folder"
    path = re.sub(r"\.tempstate\d+$", "", str(path))
    return StorageError(
        f"storage fault: {path}: {os.strerror(code)}; {_LOCAL_FAULTS[code]}, then run the same job again"
    )


# --- google-cloud-storage -----------------------------------------------------------------------


def make_client():
    """A google-cloud-storage client: anonymous on an emulator (STORAGE_EMULATOR_HOST), else ADC."""
    from google.auth import exceptions as auth_exceptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if emulator:
        return storage.Client(project="emulator", credentials=AnonymousCredentials())
    try:
        return storage.Client()
    except auth_exceptions.DefaultCredentialsError as exc:
        raise credentials_error(exc, StorageError) from None


def credentials_error(exc: Exception, kind: type[Exception]) -> Exception:
    """What google-auth's DefaultCredentialsError means to a user: a named credentials file that cannot be
    used (GOOGLE_APPLICATION_CREDENTIALS), or no credentials at all."""
    named = os.environ.get("GOOGLE_APPLICATION_CREDENTIALS")
    if named:
        return kind(
            f"the credentials file {named} (GOOGLE_APPLICATION_CREDENTIALS) cannot be used: {exc}; fix the file, "
            "or unset GOOGLE_APPLICATION_CREDENTIALS to use `gcloud auth application-default login`'s"
        )
    return kind(
        "no Google Cloud credentials found: on a TPU VM the VM's service account is used; elsewhere run "
        "`gcloud auth application-default login`"
    )


def is_transient(exc: BaseException) -> bool:
    """Errors worth retrying: 408/429/5xx answers, dropped or reset connections, timeouts."""
    import requests
    from google.api_core import exceptions as api_exceptions
    from google.auth import exceptions as auth_exceptions

    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return exc.code in _TRANSIENT_STATUS
    if isinstance(exc, (ConnectionError, TimeoutError, http.client.HTTPException)):
        return True
    if isinstance(exc, (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)):
        return True
    if isinstance(exc, auth_exceptions.TransportError):
        return True
    response = getattr(exc, "response", None)  # google.resumable_media's InvalidResponse
    return getattr(response, "status_code", None) in _TRANSIENT_STATUS


@dataclasses.dataclass
class Transfer:
    """What an upload did: files, bytes, seconds, and the retries google-cloud-storage made."""

    files: int = 0
    bytes: int = 0
    seconds: float = 0.0
    retries: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def retried(self, exc: BaseException) -> None:
        with self._lock:
            self.retries += 1
        log.debug("retrying after %s: %s", type(exc).__name__, str(exc)[:200])

    def to_dict(self) -> dict:
        return {"files": self.files, "bytes": self.bytes, "seconds": round(self.seconds, 3), "retries": self.retries}


class Uploader:
    """Uploads local files to gs:// in parallel (and reads single objects back); each request retried with
    backoff until `timeout_s` has passed."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S, workers: int = 8):
        from google.api_core.retry import Retry

        self.timeout_s, self.workers = timeout_s, workers
        self.client = make_client()
        self.transfer = Transfer()
        self.retry = Retry(
            predicate=is_transient, initial=0.5, maximum=16.0, multiplier=2.0, timeout=timeout_s,
            on_error=self.transfer.retried,
        )
        # (connect, read) seconds for one request: a stalled connection is dropped and retried.
        self.request_timeout = (min(10.0, timeout_s), min(60.0, timeout_s))

    def check_bucket(self, url: str) -> str:
        bucket, _ = split_gcs(url)
        try:
            exists = self.client.bucket(bucket).exists(retry=self.retry, timeout=self.request_timeout)
        except Exception as exc:  # noqa: BLE001 - every failure here is the bucket's, named in the message
            raise self._error(bucket, exc) from None
        if not exists:
            raise StorageError(
                f"bucket gs://{bucket} does not exist or this account cannot see it; create it with "
                f"`gcloud storage buckets create gs://{bucket}` or choose another --out"
            )
        return bucket

    def upload(self, pairs: list[tuple[str, str]], progress: Callable[[int], None] = lambda n: None) -> Transfer:
        """Uploads (local path, gs:// URL) pairs, in parallel; raises StorageError naming the bucket on failure."""
        began = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(self.workers, thread_name_prefix="upload") as pool:
            futures = {pool.submit(self._upload_one, local, url): url for local, url in pairs}
            for future in concurrent.futures.as_completed(futures):
                size = future.result()
                self.transfer.files += 1
                self.transfer.bytes += size
                progress(size)
        self.transfer.seconds += time.monotonic() - began
        return self.transfer

    def md5_of(self, url: str) -> str | None:
        """The object's MD5 as GCS gives it (base64; "" for a composite object), None when there is none: a
        content-addressed object that is already there whole need not be uploaded again."""
        from google.api_core import exceptions as api_exceptions

        bucket, name = split_gcs(url)
        blob = self.client.bucket(bucket).blob(name)
        try:
            blob.reload(retry=self.retry, timeout=self.request_timeout)
        except api_exceptions.NotFound:
            return None
        except Exception as exc:  # noqa: BLE001
            raise self._error(bucket, exc, name, "storage.objects.get") from None
        return blob.md5_hash or ""

    def download(self, url: str, max_bytes: int) -> bytes | None:
        """The object's bytes (None when there is no such object); StorageError past `max_bytes`."""
        from google.api_core import exceptions as api_exceptions

        bucket, name = split_gcs(url)
        blob = self.client.bucket(bucket).blob(name)
        try:
            blob.reload(retry=self.retry, timeout=self.request_timeout)
            if blob.size is not None and blob.size > max_bytes:
                raise StorageError(f"{url} is {blob.size:,} bytes, more than the {max_bytes:,} expected")
            return blob.download_as_bytes(retry=self.retry, timeout=self.request_timeout)
        except api_exceptions.NotFound:
            return None
        except StorageError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise self._error(bucket, exc, name, "storage.objects.get") from None

    def _upload_one(self, local: str, url: str) -> int:
        bucket, name = split_gcs(url)
        blob = self.client.bucket(bucket).blob(name)
        try:
            # Whole-file uploads of the same bytes are idempotent, so every failure may be retried.
            blob.upload_from_filename(local, retry=self.retry, timeout=self.request_timeout, checksum="crc32c")
        except Exception as exc:  # noqa: BLE001
            raise self._error(bucket, exc, name) from None
        return os.path.getsize(local)

    def _error(self, bucket: str, exc: Exception, name: str = "",
               permission: str = "storage.objects.create") -> StorageError:
        from google.api_core import exceptions as api_exceptions

        target = f"gs://{bucket}/{name}" if name else f"gs://{bucket}"
        if isinstance(exc, api_exceptions.RetryError) or is_transient(exc):
            cause = exc.cause if isinstance(exc, api_exceptions.RetryError) and exc.cause else exc
            return StorageError(
                f"storage unreachable: {target} did not answer within {self.timeout_s:g} s "
                f"({self.transfer.retries} retries; last: {type(cause).__name__}: {str(cause)[:200]})"
            )
        if isinstance(exc, api_exceptions.Forbidden):
            return StorageError(f"{target}: permission denied; the account needs {permission} on gs://{bucket}")
        return StorageError(f"{target}: {type(exc).__name__}: {str(exc)[:300]}")


def is_file(path: str) -> bool:
    """Whether `path` (local or gs://) is a file, not a folder; False when it cannot be told."""
    import tensorflow as tf  # this module is read before TensorFlow loads (configure_tensorflow)

    try:
        return tf.io.gfile.exists(path) and not tf.io.gfile.isdir(path)
    except tf.errors.OpError:
        return False
