"""How `runner doctor --cloud` reads an answer from a cloud API: present, refused with an HTTP status (403:
denied, 404: missing), or nothing at all (connection refused, DNS, TLS, a timeout: unreachable); and the bound
every call runs under (a daemon thread: a DNS lookup ignores socket timeouts)."""

from __future__ import annotations

import time
import urllib.error
from collections.abc import Callable

from runner.device.bounded import Bounded
from runner.doctor.checks import Check


def region(zone: str) -> str:
    return zone.rsplit("-", 1)[0]


def reason(exc: BaseException) -> str:
    text = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    if hasattr(exc, "body") and hasattr(exc, "reason"):  # kubernetes' ApiException: str() carries every header
        text = f"{exc.reason}: {str(exc.body)[:200]}"
    return f"{type(exc).__name__}: {' '.join(str(text).split())[:300]}"


def unreachable(exc: BaseException) -> bool:
    """Connection refused, DNS, TLS and timeouts: nothing answered (as opposed to an HTTP refusal)."""
    import requests
    import urllib3

    nothing = (OSError, urllib.error.URLError, requests.exceptions.ConnectionError, requests.exceptions.Timeout,
               urllib3.exceptions.HTTPError)  # kubernetes' client raises urllib3's own (MaxRetryError)
    return isinstance(exc, nothing) and not isinstance(exc, urllib.error.HTTPError)


def status_of(exc: BaseException) -> int | None:
    """The HTTP status of a refusal from google-api-core, google-cloud-storage, kubernetes or urllib."""
    for attribute in ("code", "status"):
        value = getattr(exc, attribute, None)
        if isinstance(value, int):
            return value
    return None


def bounded(name: str, seconds: float, fn: Callable[[], Check]) -> Check:
    began = time.monotonic()
    try:
        check = Bounded(f"doctor-{name}", fn).result(seconds)
    except TimeoutError:
        check = Check(name, "fail", f"unreachable: no answer within {seconds:g} s",
                      "check DNS, the network, and any https_proxy; raise --timeout for a slow link")
    except Exception as exc:  # a check that broke is a row of the report, not a broken doctor
        check = Check(name, "fail", f"the check itself failed: {reason(exc)}", "report this as a bug")
    check.seconds = round(time.monotonic() - began, 3)
    return check
