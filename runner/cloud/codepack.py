"""The code a submitted job takes with it (docs/cloud.md, "Sending your code"): the spec's code folder and the
user's own packages (`code.packages`) packed by `runner submit` into one archive named by its sha256, which
runner/cloud/codefetch.py uploads beside the run folder and fetches again in the container.

What is packed is what the spec can reach, found the way `runner validate` finds it (runner/spec/usercode.py):
  - the code folder (`code.folder`, else the spec file's folder), when an import path of the spec lies in it,
    as `folder/` in the archive;
  - each package of `code.packages` installed on this machine (from its folder, or on PYTHONPATH: the spec's
    loader has already refused third-party ones), as `packages/<name>/` (or `packages/<name>.py`), unless it
    lies inside the code folder sent anyway. One that is not installed here is left to the image, as before.
What is left out, in each of those trees, and said in the dry run (LEFT_OUT, checked in this order):
  - hidden files and folders (a name starting with '.': .git, .env, .venv, .ssh, .aws, caches of tools);
  - virtualenvs (a folder holding pyvenv.cfg, or named venv), __pycache__, *.pyc/*.pyo, *.egg-info,
    node_modules; symbolic links (their targets are not followed);
  - private keys and credentials (*.pem, *.key, *.p12, *.pfx, *.jks, *.keystore, id_rsa*, id_ed25519*, ...,
    *credentials*.json, and any .json holding a "private_key": a service account's key);
  - data files (DATA_PATTERNS: TFRecords, npz/npy, csv/tsv, parquet, HDF5, .keras, pickles, checkpoints,
    images, audio, video, archives) and any file over MAX_FILE_BYTES;
  - what a `.runnerignore` at the top of the tree says, in gitignore's form (`#` comments, `*`, `?`, `[...]`,
    `**`, a trailing `/` for folders only, a `/` inside or in front anchors the pattern to the top). Its `!`
    patterns may send back a data file or one over the size limit; never a hidden file, a key or a cache.
The archive is a tar.gz made the same way every time (sorted names, no times, no owners), so the same code
has the same name and is not uploaded twice. The whole is refused over MAX_ARCHIVE_BYTES, naming its biggest
files. Nothing here imports the user's code, TensorFlow or google-cloud-storage.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import gzip
import hashlib
import io
import os
import re
import stat
import tarfile

from runner import SpecError
from runner.spec.packages import inside, installed_spec
from runner.spec.usercode import CodeRoots, find_code

MAX_FILE_BYTES = 5 << 20  # a larger file is data or a model, which belong in the bucket
MAX_ARCHIVE_BYTES = 64 << 20  # the files' total before compression
IGNORE_FILE = ".runnerignore"
FOLDER, PACKAGES = "folder", "packages"  # the archive's two trees (runner/cloud/codefetch.py unpacks them)
_SHOWN_FILES = 40  # files listed one by one in the dry run; the rest counted

SECRET_PATTERNS = ("*.pem", "*.key", "*.p12", "*.pfx", "*.jks", "*.keystore", "id_rsa*", "id_dsa*", "id_ecdsa*",
                   "id_ed25519*", "*credentials*.json", "netrc", "_netrc")
DATA_PATTERNS = ("*.tfrecord", "*.tfrecords", "*.tfrecord.gz", "*.npz", "*.npy", "*.csv", "*.tsv", "*.parquet",
                 "*.arrow", "*.feather", "*.h5", "*.hdf5", "*.keras", "*.pkl", "*.pickle", "*.ckpt",
                 "*.data-?????-of-?????", "*-ubyte", "*.jpg", "*.jpeg", "*.png", "*.gif", "*.bmp", "*.tif",
                 "*.tiff", "*.webp", "*.wav", "*.mp3", "*.flac", "*.mp4", "*.zip", "*.tar", "*.gz", "*.tgz",
                 "*.bz2", "*.xz", "*.7z")
# Reasons a .runnerignore `!pattern` may overrule: the file is only big or looks like data.
_OVERRULED = ("data", "size")


@dataclasses.dataclass(frozen=True)
class Entry:
    name: str  # in the archive: folder/... or packages/...
    source: str  # the file on this machine
    size: int


@dataclasses.dataclass(frozen=True)
class LeftOut:
    path: str  # as in the archive, a folder with a trailing /
    reason: str


@dataclasses.dataclass(frozen=True)
class CodePack:
    """What a submission sends: the files, what was left out and why, and the archive (none when no file is
    sent). `ref` is what the container is handed (RUNNER_CODE): the archive's URL and its sha256."""

    roots: tuple[str, ...]  # what was packed, as the dry run says it
    entries: tuple[Entry, ...]
    left_out: tuple[LeftOut, ...]
    left_to_image: tuple[str, ...]  # code.packages not installed here
    archive: bytes = b""
    sha256: str = ""
    url: str = ""

    @property
    def ref(self) -> str | None:
        return f"{self.url}#sha256={self.sha256}" if self.entries else None

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries)


# --- .runnerignore --------------------------------------------------------------------------------------


def _translate(pattern: str) -> str:
    """One gitignore pattern (no `!`, no trailing `/`) as a regular expression over a /-separated path."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and (end := pattern.find("]", i + 2)) > 0:
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body).replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return "".join(out)


class IgnoreRules:
    """A .runnerignore's patterns; `verdict(path, is_dir)`: True (left out), False (sent back by a `!`
    pattern) or None (no pattern matches). The last matching pattern decides, as in git."""

    def __init__(self, text: str = ""):
        self.rules: list[tuple[re.Pattern[str], bool, bool, str]] = []
        for line in text.splitlines():
            line = line.rstrip()
            if not line or line.startswith("#"):
                continue
            negate = line.startswith("!")
            pattern = line[1:] if negate else line
            pattern = pattern[1:] if pattern.startswith("\\") else pattern  # \# and \! stand for themselves
            folders_only = pattern.endswith("/")
            pattern = pattern.rstrip("/")
            if not pattern:
                continue
            anchored = "/" in pattern
            regex = ("" if anchored else "(?:.*/)?") + _translate(pattern.lstrip("/")) + "$"
            self.rules.append((re.compile(regex), negate, folders_only, line))

    @classmethod
    def of(cls, root: str) -> IgnoreRules:
        path = os.path.join(root, IGNORE_FILE)
        try:
            with open(path, encoding="utf-8") as handle:
                return cls(handle.read(1 << 20))
        except (FileNotFoundError, NotADirectoryError):
            return cls()
        except (OSError, UnicodeDecodeError) as exc:
            raise SpecError(f"{path}: cannot be read ({exc}); fix or remove it") from None

    def verdict(self, path: str, is_dir: bool) -> tuple[bool, str] | None:
        found = None
        for regex, negate, folders_only, line in self.rules:
            if (is_dir or not folders_only) and regex.match(path):
                found = (not negate, line)
        return found


# --- the rules -------------------------------------------------------------------------------------------


def _folder_reason(path: str, name: str) -> str | None:
    if name.startswith("."):
        return "a hidden folder"
    if name in ("venv", "virtualenv") or os.path.exists(os.path.join(path, "pyvenv.cfg")):
        return "a virtualenv"
    if name == "__pycache__" or name.endswith((".egg-info", ".dist-info")) or name == "node_modules":
        return "a cache or build metadata"
    return None


def _file_reason(path: str, name: str, size: int) -> tuple[str, str] | None:
    """(kind, reason) of a rule that leaves the file out; kind "data" and "size" a `!` pattern may overrule."""
    lower = name.lower()
    if lower.startswith("."):
        return "hidden", "a hidden file (.env and the like hold secrets)"
    if any(fnmatch.fnmatchcase(lower, p) for p in SECRET_PATTERNS) or _holds_private_key(path, lower, size):
        return "secret", "a private key or credentials"
    if lower.endswith((".pyc", ".pyo")):
        return "cache", "compiled Python"
    if matched := next((p for p in DATA_PATTERNS if fnmatch.fnmatchcase(lower, p)), None):
        return "data", f"a data file ({matched}): data belongs in the bucket"
    if size > MAX_FILE_BYTES:
        return "size", f"{size:,} bytes, over the limit of {MAX_FILE_BYTES:,} ({_bytes(MAX_FILE_BYTES)}) per file"
    return None


def _holds_private_key(path: str, lower: str, size: int) -> bool:
    """A .json file with a "private_key" field: a service account's key, whatever its name."""
    if not lower.endswith(".json") or size > MAX_FILE_BYTES:
        return False
    try:
        with open(path, "rb") as handle:
            return b'"private_key"' in handle.read()
    except OSError:
        return False


# --- walking a tree --------------------------------------------------------------------------------------


def _walk(root: str, prefix: str, entries: list[Entry], left_out: list[LeftOut]) -> None:
    """Every file under `root` the rules send, as `prefix/relative/path`; the others into `left_out`."""
    rules = IgnoreRules.of(root)

    def visit(folder: str, relative: str) -> None:
        try:
            names = sorted(os.listdir(folder))
        except OSError as exc:
            raise SpecError(f"cannot read {folder} to send it with the job: {exc}") from None
        for name in names:
            path = os.path.join(folder, name)
            rel = f"{relative}{name}"
            if rel == IGNORE_FILE:
                continue  # the rules themselves: read here, not needed there
            shown = f"{prefix}/{rel}"
            info = os.lstat(path)
            is_dir = stat.S_ISDIR(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                left_out.append(LeftOut(shown, "a symbolic link (its target is not followed)"))
                continue
            if not is_dir and not stat.S_ISREG(info.st_mode):
                left_out.append(LeftOut(shown, "not a regular file"))
                continue
            asked = rules.verdict(rel, is_dir)
            if is_dir:
                reason = _folder_reason(path, name)
                if reason is None and asked and asked[0]:
                    reason = f"{IGNORE_FILE}: {asked[1]}"
                if reason:
                    left_out.append(LeftOut(shown + "/", reason))
                else:
                    visit(path, rel + "/")
                continue
            kind_reason = _file_reason(path, name, info.st_size)
            if kind_reason and asked and not asked[0] and kind_reason[0] in _OVERRULED:
                kind_reason = None  # sent back by a `!` pattern
            if kind_reason is None and asked and asked[0]:
                kind_reason = ("ignored", f"{IGNORE_FILE}: {asked[1]}")
            if kind_reason:
                left_out.append(LeftOut(shown, kind_reason[1]))
            else:
                entries.append(Entry(shown, path, info.st_size))

    visit(root, "")


# --- what the spec reaches ----------------------------------------------------------------------------


def code_to_send(import_paths: dict[str, str], roots: CodeRoots, run_dir: str) -> tuple[CodePack | None, list[str]]:
    """The code a spec's import paths reach (found as `runner validate` finds it, nothing imported), packed;
    and the problems that stop a submission. None when the spec names no code of its own and lists no
    package."""
    if not import_paths and not roots.packages:
        return None, []
    problems: list[str] = []
    folder_needed, left_to_image = False, set()
    for key, path in import_paths.items():
        top = path.partition(":")[0].split(".")[0]
        try:
            folder_needed |= find_code(path, key, roots).in_folder
        except SpecError as error:
            if top in roots.packages and installed_spec(top) is None:
                left_to_image.add(top)  # not here: the image must have it, as before code was sent
            else:
                problems.append(f"{error} (`runner submit` sends your code from this machine)")
    entries: list[Entry] = []
    left_out: list[LeftOut] = []
    described: list[str] = []
    folder = os.path.realpath(roots.folder)
    if folder_needed:
        described.append(f"code.folder {roots.folder}")
        _walk(roots.folder, FOLDER, entries, left_out)
    for name in roots.packages:
        spec = installed_spec(name)
        if spec is None:
            left_to_image.add(name)
            continue
        locations = list(spec.submodule_search_locations or [])
        places = locations or ([spec.origin] if spec.has_location and spec.origin else [])
        if folder_needed and all(inside(os.path.realpath(p), folder) for p in places):
            described.append(f"code.packages {name} (in the code folder)")
            continue
        described.append(f"code.packages {name} ({', '.join(places)})")
        for place in places:
            if os.path.isdir(place):
                _walk(place, f"{PACKAGES}/{name}", entries, left_out)
            elif place.endswith(".py"):
                entries.append(Entry(f"{PACKAGES}/{name}.py", place, os.path.getsize(place)))
            else:
                problems.append(f"code.packages lists {name!r}, which is {place}: only Python source (a package "
                                "folder or a .py module) can be sent with the job; install it in the image")
    total = sum(e.size for e in entries)
    if total > MAX_ARCHIVE_BYTES:
        biggest = ", ".join(f"{e.name} ({_bytes(e.size)})" for e in sorted(entries, key=lambda e: -e.size)[:5])
        problems.append(f"the code to send is {_bytes(total)}, over the {_bytes(MAX_ARCHIVE_BYTES)} limit; the "
                        f"biggest files: {biggest}; list what the job does not need in {IGNORE_FILE} (docs/cloud.md, "
                        "\"Sending your code\")")
    if problems or not entries:
        return CodePack(tuple(described), (), tuple(left_out), tuple(sorted(left_to_image))), problems
    archive = make_archive(entries)
    sha = hashlib.sha256(archive).hexdigest()
    pack = CodePack(tuple(described), tuple(entries), tuple(left_out), tuple(sorted(left_to_image)), archive, sha,
                    archive_url(run_dir, sha))
    return pack, []


def archive_url(run_dir: str, sha256: str) -> str:
    """Where the archive goes: beside the run's own files, named by its content."""
    return f"{run_dir.rstrip('/')}/code/{sha256}.tar.gz"


def make_archive(entries: list[Entry] | tuple[Entry, ...]) -> bytes:
    """A tar.gz of the entries, the same bytes for the same files: sorted, no times, owners or names of hosts."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buffer, mtime=0) as zipped:
        with tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for entry in sorted(entries, key=lambda e: e.name):
                with open(entry.source, "rb") as handle:
                    data = handle.read()
                info = tarfile.TarInfo(entry.name)
                info.size, info.mtime, info.uid, info.gid, info.uname, info.gname = len(data), 0, 0, 0, "", ""
                info.mode = 0o755 if os.access(entry.source, os.X_OK) else 0o644
                tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


# --- what the dry run says ---------------------------------------------------------------------------


def describe(pack: CodePack | None) -> list[str]:
    """The lines `runner submit` prints about the code it sends (a dry run's too)."""
    if pack is None:
        return []
    lines = []
    if pack.entries:
        lines.append(f"code: {pack.url} ({len(pack.entries)} files, {_bytes(pack.size)}; "
                     f"{_bytes(len(pack.archive))} compressed) from {'; '.join(pack.roots)}")
        shown = pack.entries[:_SHOWN_FILES]
        lines += [f"code:   {e.name} ({_bytes(e.size)})" for e in shown]
        if len(pack.entries) > len(shown):
            lines.append(f"code:   ... and {len(pack.entries) - len(shown)} more")
    else:
        lines.append("code: nothing to send: " + ("; ".join(pack.roots) or "the spec names no code of this machine"))
    if pack.left_out:
        lines.append("code: left out: " + "; ".join(f"{x.path} ({x.reason})" for x in pack.left_out))
    for name in pack.left_to_image:
        lines.append(f"code: code.packages {name!r} is not installed here, so it is not sent: the image must have it")
    return lines


def _bytes(count: int) -> str:
    for unit, size in (("MB", 1 << 20), ("KB", 1 << 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count} B"
