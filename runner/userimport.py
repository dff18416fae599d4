"""The one way a job spec reaches user code: an import path `package.module:function`.

A spec is data. It never carries code: it can only name a callable that is already importable in the
image (installed or on PYTHONPATH), and the runner imports that module and calls that function with
arguments of its own. There is no eval, no pickle, no code fetched from the bucket.
`check_import_path` checks the form at spec load (no import); `load_callable` imports at start-up
and turns every way that can fail into a SpecError (exit 2) that names the path and what was found.
This module imports no TensorFlow.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from types import ModuleType
from typing import Any, Callable

from runner.errors import SpecError

_IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
IMPORT_PATH = re.compile(rf"{_IDENTIFIER}(\.{_IDENTIFIER})*:{_IDENTIFIER}")
# Modules whose callables run arbitrary code from their arguments; no build function lives there.
_REFUSED_MODULES = frozenset({"builtins", "os", "subprocess", "sys", "pickle", "marshal", "shutil", "importlib"})


def is_import_path(value: str) -> bool:
    """True when `value` asks for user code (it has a colon), as opposed to naming a built-in."""
    return ":" in value


def check_import_path(value: str) -> str:
    """Validates the form `package.module:function` (no import); raises ValueError for the spec loader."""
    if not IMPORT_PATH.fullmatch(value):
        raise ValueError(
            f"{value!r} is not an import path: write `package.module:function` "
            "(dotted module, one colon, a function name), e.g. `my_models.cnn:build`"
        )
    module = value.partition(":")[0]
    if module.split(".")[0] in _REFUSED_MODULES:
        raise ValueError(
            f"{value!r} names the standard module {module!r}; name a function of your own package instead"
        )
    return value


def load_callable(path: str, key: str, arguments: tuple[str, ...]) -> Callable[..., Any]:
    """Imports `path` (`package.module:function`) and checks it can be called with `arguments` positionally.

    `key` is the spec key that named it (e.g. `model.name`), quoted in every error.
    """
    _check_form(path, key)
    module_name, _, attribute = path.partition(":")
    module = _import(module_name, path, key)
    if not hasattr(module, attribute):
        found = _callables_in(module)
        listing = ", ".join(found) if found else "no public functions or classes"
        raise SpecError(
            f"{key}: module {module_name!r} ({_origin(module)}) has no attribute {attribute!r}; "
            f"it defines: {listing}"
        )
    target = getattr(module, attribute)
    if not callable(target):
        shown = repr(target) if len(repr(target)) <= 40 else repr(target)[:37] + "..."
        raise SpecError(f"{key}: {path!r} is not callable (a {type(target).__name__}: {shown}); name a function")
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target)):
        # C built-ins and odd callables (functools.partial of os.system, ...) are not build functions.
        raise SpecError(f"{key}: {path!r} is a {type(target).__name__}; name a Python function defined in your package")
    _check_signature(target, path, key, arguments)
    return target


def _check_form(path: str, key: str) -> None:
    try:
        check_import_path(path)
    except ValueError as exc:
        raise SpecError(f"{key}: {exc}") from None


def _import(module_name: str, path: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise SpecError(
                f"{key}: cannot import {module_name!r} for {path!r} ({exc}); install your package in the "
                f"image (pip install) or add its folder to PYTHONPATH (searched: {_search_path()})"
            ) from exc
        raise SpecError(f"{key}: importing {module_name!r} for {path!r} failed: it needs {missing!r} ({exc})") from exc
    except SyntaxError as exc:
        raise SpecError(f"{key}: {exc.filename}:{exc.lineno}: syntax error in {module_name!r}: {exc.msg}") from exc
    except Exception as exc:  # the user's module raised while importing: name it, keep the cause for --debug
        raise SpecError(f"{key}: importing {module_name!r} for {path!r} raised {type(exc).__name__}: {exc}") from exc


def _callables_in(module: ModuleType) -> list[str]:
    """Public functions and classes of the module, its own first (those are the likely build functions)."""
    public = {
        n: v for n, v in vars(module).items() if not n.startswith("_") and (inspect.isfunction(v) or inspect.isclass(v))
    }
    own = sorted(n for n, v in public.items() if getattr(v, "__module__", None) == module.__name__)
    return own or sorted(public)


def _check_signature(target: Callable[..., Any], path: str, key: str, arguments: tuple[str, ...]) -> None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        raise SpecError(f"{key}: cannot read the signature of {path!r}; name a plain Python function") from None
    try:
        signature.bind(*arguments)
    except TypeError as exc:
        name = path.partition(":")[2]
        raise SpecError(
            f"{key}: {path!r} has signature {name}{signature}, but the runner calls it as "
            f"{name}({', '.join(arguments)}) ({exc})"
        ) from None


def _origin(module: ModuleType) -> str:
    return getattr(module, "__file__", None) or "a namespace package"


def _search_path() -> str:
    shown = [p or "." for p in sys.path[:6]]
    return ", ".join(shown) + (", ..." if len(sys.path) > 6 else "")
