"""The code archive's trip (docs/cloud.md, "Sending your code"): `runner submit` uploads the archive that
runner/cloud/codepack.py made, once per content; the job's container is handed its URL and sha256 in
RUNNER_CODE (`gs://BUCKET/.../RUN/code/SHA256.tar.gz#sha256=SHA256`; `runner run`, `evaluate` and `predict`
take the same as --code), and the command fetches it, checks the hash, unpacks it into a fresh folder (removed
when the process ends) and puts it where the spec's code boundary looks, before the spec is loaded:
  - `folder/` becomes code.folder (`--set code.folder=...` added to the job's overrides);
  - `packages/` is appended to sys.path, never put in front: it adds packages, it replaces none. A package
    the archive holds that Python would import from elsewhere (the image has one of that name) is refused,
    naming both places.
A missing archive or one whose sha256 differs is refused with exit 2 naming the object (DataError: running it
again cannot help); a bucket that does not answer is exit 3 (StorageError). Imports no TensorFlow: this runs
before anything TensorFlow reads at start-up is set.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import posixpath
import re
import shutil
import tarfile
import tempfile

from runner import DataError, SpecError
from runner.cloud.codepack import FOLDER, MAX_ARCHIVE_BYTES, PACKAGES, CodePack
from runner.data import storage
from runner.spec.packages import put_on_path

ENV = "RUNNER_CODE"
_REF = re.compile(r"(gs://[^#\s]+)#sha256=([0-9a-f]{64})")


@dataclasses.dataclass(frozen=True)
class Unpacked:
    url: str
    sha256: str
    root: str  # the fresh folder it was unpacked into
    files: int
    packages: tuple[str, ...]

    @property
    def folder(self) -> str:
        return os.path.join(self.root, FOLDER)

    def overrides(self) -> list[str]:
        """What `runner run` adds to the spec's overrides: the unpacked folder as the code folder."""
        return [f"code.folder={self.folder}"]

    def line(self) -> str:
        listed = f"; code.packages from it: {', '.join(self.packages)}" if self.packages else ""
        return (f"code: {self.url} (sha256 checked): {self.files} files unpacked in {self.root}; "
                f"code.folder is {self.folder}{listed}")


def upload(pack: CodePack, timeout_s: float) -> str:
    """Puts the archive at pack.url unless the same bytes are there already; says which it did."""
    import base64

    uploader = storage.Uploader(timeout_s, workers=1)
    md5 = base64.b64encode(hashlib.md5(pack.archive).digest()).decode()  # noqa: S324 - GCS's own checksum
    there = uploader.md5_of(pack.url)
    if there == md5:
        return f"code: {pack.url} is already in the bucket: not uploaded again"
    with tempfile.NamedTemporaryFile(suffix=".tar.gz") as handle:
        handle.write(pack.archive)
        handle.flush()
        uploader.upload([(handle.name, pack.url)])
    replaced = " (it replaced an object of that name with other bytes)" if there is not None else ""
    return f"code: uploaded {pack.url}, {len(pack.archive):,} bytes{replaced}"


def parse_ref(ref: str) -> tuple[str, str]:
    """(url, sha256) of a RUNNER_CODE value; SpecError naming the form when it is not one."""
    found = _REF.fullmatch(ref.strip())
    if found is None:
        raise SpecError(f"{ENV} (or --code) {ref!r} is not gs://BUCKET/PATH.tar.gz#sha256=HEX (64 lowercase hex "
                        "digits): `runner submit` sets it; unset it to run the spec's own code folder")
    return found.group(1), found.group(2)


def fetch(ref: str, timeout_s: float = storage.DEFAULT_TIMEOUT_S, into: str | None = None) -> Unpacked:
    """Fetches the archive RUNNER_CODE names, checks its sha256, unpacks it into a fresh folder (under `into`,
    else the temporary folder) and appends its packages to sys.path."""
    url, sha = parse_ref(ref)
    data = storage.Uploader(timeout_s, workers=1).download(url, 2 * MAX_ARCHIVE_BYTES)
    if data is None:
        raise DataError(f"the code archive {url} is not in the bucket ({ENV}): `runner submit` uploads it before "
                        "the job starts; was it deleted? Submit the job again to upload it")
    got = hashlib.sha256(data).hexdigest()
    if got != sha:
        raise DataError(f"the code archive {url} has sha256 {got}, not the {sha} `runner submit` sent ({ENV}): it "
                        "changed after it was uploaded, so it is not run. Submit the job again: the archive is "
                        "uploaded anew")
    root = tempfile.mkdtemp(prefix=f"runner-code-{sha[:12]}-", dir=into)
    atexit.register(shutil.rmtree, root, True)  # the process's own copy: the bucket keeps the archive
    files = _unpack(data, root, url)
    os.makedirs(os.path.join(root, FOLDER), exist_ok=True)
    return Unpacked(url, sha, root, files, _use_packages(os.path.join(root, PACKAGES), url))


def _unpack(data: bytes, root: str, url: str) -> int:
    """Writes the archive's regular files under `root`; anything else (a link, a device, a path that leaves
    the folder or lies outside its two trees) refuses the whole archive."""
    import io

    count = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
            for member in tar:
                name = posixpath.normpath(member.name)
                top = name.split("/")[0]
                if member.isdir():
                    continue
                if (not member.isfile() or name.startswith(("/", "..")) or top not in (FOLDER, PACKAGES)
                        or name in (FOLDER, PACKAGES)):
                    raise DataError(f"the code archive {url} holds {member.name!r}, which `runner submit` never "
                                    "packs (only files under folder/ and packages/): it is not run")
                target = os.path.join(root, *name.split("/"))
                os.makedirs(os.path.dirname(target), exist_ok=True)
                source = tar.extractfile(member)
                with open(target, "wb") as handle:
                    handle.write(source.read() if source else b"")
                os.chmod(target, 0o755 if member.mode & 0o100 else 0o644)
                count += 1
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise DataError(f"the code archive {url} cannot be unpacked: {exc}") from None
    return count


def _use_packages(folder: str, url: str) -> tuple[str, ...]:
    """Appends the archive's packages to sys.path; refuses one Python would import from elsewhere."""
    if not os.path.isdir(folder):
        return ()
    names = sorted(n.removesuffix(".py") for n in os.listdir(folder) if not n.startswith("."))
    name, where = put_on_path(folder, names)
    if name is not None:
        raise SpecError(f"code.packages {name!r} came in the code archive {url}, but Python imports {name!r} "
                        f"from {where}, which this image has; rename your package, or take it out of the image")
    return tuple(names)
