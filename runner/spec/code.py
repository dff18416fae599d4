"""The `code:` section of a job spec: where its import paths may point (runner/spec/usercode.py) and the extra
pip packages its code imports (runner/spec/requirements.py); docs/specs.md, "A job spec is code"."""

from __future__ import annotations

import sys
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator

from runner.spec.base import Strict
from runner.spec.packages import check_package_is_yours
from runner.spec.paths import resolve_path
from runner.spec.requirements import check_requirement, check_requirements
from runner.spec.usercode import IDENTIFIER, system_folder_problem


class CodeSpec(Strict):
    """Where the spec's import paths (`package.module:function`) may point: a job spec names code, so it must
    be trusted like a Python script, and it reaches only the code it declares here (docs/specs.md)."""

    # The folder holding your own modules. Unset: the spec file's folder.
    folder: str | None = Field(None, validate_default=True)
    # Installed packages (pip install, PYTHONPATH) the spec may also name, by top-level name: [fashionnet].
    packages: tuple[Annotated[str, Field(pattern=rf"^{IDENTIFIER}$", max_length=128)], ...] = Field((), max_length=64)
    # Extra pip packages your code imports, each pinned (NAME==VERSION, optionally --hash=sha256:HEX), installed
    # without their dependencies before the job; none the runner pins (runner/spec/requirements.py).
    requirements: tuple[Annotated[str, Field(max_length=4096)], ...] = Field((), max_length=64)

    @field_validator("folder")
    @classmethod
    def _resolve(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return (info.context or {}).get("base")
        path = resolve_path(value, ("code", "folder"), info.context)
        if path.startswith("gs://"):
            raise ValueError(f"{path!r}: code is imported from a local folder, not from a bucket")
        if problem := system_folder_problem(path):
            raise ValueError(f"{problem}; set code.folder to the folder of your own modules")
        return path

    @field_validator("packages")
    @classmethod
    def _packages_are_yours(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            if name in sys.stdlib_module_names or name == "runner":
                owner = "the runner itself" if name == "runner" else "Python's standard library"
                raise ValueError(f"{name!r} is {owner}, not a package of yours; list only your own packages")
            check_package_is_yours(name)
        return value

    @field_validator("requirements")
    @classmethod
    def _pinned(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return check_requirements(tuple(check_requirement(entry) for entry in value))
