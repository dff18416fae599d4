"""YAML within bounds: `parse_yaml` turns untrusted text into Python values, or a SpecError naming the line,
in bounded time and memory whatever the text. This module imports no TensorFlow.

libyaml parses; its event stream is walked first (nothing built) and stops at more than MAX_DEPTH levels of
nesting (PyYAML's C composer recurses once per level and crashes the process on a few thousand), more than
MAX_VALUES values, or several documents. The node tree is then measured with each alias counted every time it
is used, so an alias bomb stops at MAX_VALUES instead of expanding exponentially downstream. Keys must be
plain, unique names; `!!binary` and over-long integers are refused; any other failure to build a value (a date
such as 2024-13-45) becomes a SpecError at that value's line.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

from runner import SpecError

# A job spec is a few dozen lines; these bounds are far above any real one and far below any harm.
MAX_BYTES = 1 << 20
MAX_DEPTH = 20
MAX_VALUES = 5_000


# Keys whose mapping takes integer keys as Keras writes them: class_weight maps class ids to weights.
INT_KEYED = frozenset({"class_weight"})


class _Loader(yaml.CSafeLoader):
    """libyaml's safe loader; keys must be plain scalars and unique (integers only under INT_KEYED), no binary,
    integers of sane length, and any other failure while building a value becomes a SpecError at that value's
    line."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.int_key_nodes: set[int] = set()  # ids of the mappings whose keys may be integers

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (SpecError, yaml.YAMLError):
            raise
        except Exception as exc:  # a date such as 2024-13-45, a number Python cannot hold
            raise SpecError(f"cannot read the value {shown(str(node.value))}: {exc}", line=_line(node)) from None


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    int_keys = id(node) in loader.int_key_nodes
    for key_node, value_node in node.value:
        if not isinstance(key_node, yaml.ScalarNode):
            kind = "list" if isinstance(key_node, yaml.SequenceNode) else "mapping"
            raise SpecError(f"a key must be a plain name, not a {kind} (`? [a, b]` keys mean nothing in a job spec)",
                            line=_line(key_node))
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # `<<: *defaults`, merged by construct_mapping
        key = loader.construct_object(key_node, deep=True)
        if key in INT_KEYED and isinstance(value_node, yaml.MappingNode):
            loader.int_key_nodes.add(id(value_node))
        if int_keys and type(key) is int:
            pass
        elif not isinstance(key, str):
            raise SpecError(f"the key {shown(key_node.value)} reads as {_yaml_type(key)} in YAML, not as a name; "
                            "quote it if you mean the word", line=_line(key_node))
        if key in seen:
            raise SpecError(f"duplicate key {shown(str(key))} (first at line {seen[key]})", line=_line(key_node))
        seen[key] = _line(key_node)
    return loader.construct_mapping(node, deep=deep)


def _yaml_type(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number"}.get(type(value), f"a {type(value).__name__}")


def _construct_int(loader: _Loader, node: yaml.ScalarNode) -> int:
    if len(node.value) > 40:  # Python refuses to parse more than 4,300 digits; no field takes more than 20
        raise SpecError(f"an integer of {len(node.value):,} characters is beyond any range the runner uses",
                        line=_line(node))
    return yaml.constructor.SafeConstructor.construct_yaml_int(loader, node)


def _refuse_binary(loader: _Loader, node: yaml.ScalarNode) -> None:
    raise SpecError("!!binary values have no place in a job spec: write text", line=_line(node))


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
_Loader.add_constructor("tag:yaml.org,2002:int", _construct_int)
_Loader.add_constructor("tag:yaml.org,2002:binary", _refuse_binary)
# A number with an exponent and no dot (1e-4, 1e-07 as json.dumps writes it) is a float in YAML 1.2 and JSON,
# but text in YAML 1.1, which libyaml follows: read it as the number it is (Keras's serialized configs, pasted,
# are full of them; as text they failed inside Keras mid-training).
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def _line(node: yaml.Node | yaml.Event) -> int:
    return node.start_mark.line + 1


def shown(text: str, limit: int = 80) -> str:
    """`text` quoted for a message: escaped (control characters, undecodable bytes) and cut to `limit`."""
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 4] + "...'"


def _scan(text: str) -> None:
    """Walks libyaml's event stream (nothing is built) and stops at the first bound passed."""
    depth = values = documents = 0
    for event in yaml.parse(text, Loader=yaml.CSafeLoader):
        if isinstance(event, yaml.DocumentStartEvent):
            documents += 1
            if documents > 1:
                raise SpecError("the file holds several YAML documents (`---`); a job spec is one", line=_line(event))
        elif isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            if depth > MAX_DEPTH:
                raise SpecError(f"nested more than {MAX_DEPTH} levels deep; a job spec needs a few", line=_line(event))
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
        if isinstance(event, yaml.NodeEvent):
            values += 1
            if values > MAX_VALUES:
                raise SpecError(f"more than {MAX_VALUES:,} values; a job spec holds far fewer", line=_line(event))


def _check_expansion(root: yaml.Node) -> None:
    """Aliases reuse a node wherever they point: counted as often as they are used, the values must stay
    within MAX_VALUES and MAX_DEPTH (an alias bomb would otherwise expand exponentially downstream).
    Each node is measured once, so this costs the size of the text, not of the expansion."""
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (values, height), expanded
    open_nodes: set[int] = set()

    def too_deep(node: yaml.Node) -> SpecError:
        return SpecError(f"aliases nest values more than {MAX_DEPTH} levels deep", line=_line(node))

    def measure(node: yaml.Node, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise too_deep(node)
        known = measured.get(id(node))
        if known is not None:
            if depth + known[1] - 1 > MAX_DEPTH:
                raise too_deep(node)
            return known[0]
        if id(node) in open_nodes:
            raise SpecError("an alias refers to the mapping or list that holds it (a loop)", line=_line(node))
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [part for pair in node.value for part in pair]
        else:
            children = []
        open_nodes.add(id(node))
        values, height = 1, 1
        for child in children:
            values += measure(child, depth + 1)
            height = max(height, measured[id(child)][1] + 1)
            if values > MAX_VALUES:
                raise SpecError(f"aliases expand to more than {MAX_VALUES:,} values; a job spec holds far fewer",
                                line=_line(node))
        open_nodes.discard(id(node))
        measured[id(node)] = (values, height)
        return values

    measure(root, 1)


def parse_yaml(text: str, int_keys: bool = False) -> tuple[Any, yaml.Node | None]:
    """The YAML text as Python values and its node tree (for key lines), within the module's bounds.
    `int_keys`: the text is the value of an INT_KEYED key (`--set train.class_weight={0: 1, 1: 3}`).

    Raises SpecError carrying the line (no file: the caller knows where the text came from)."""
    try:
        _scan(text)
        loader = _Loader(text)
        node = loader.get_single_node()
        if node is None:
            return None, None
        if int_keys and isinstance(node, yaml.MappingNode):
            loader.int_key_nodes.add(id(node))
        _check_expansion(node)
        try:
            return loader.construct_document(node), node
        except SpecError as exc:  # name the key of the value that could not be built
            keys = [path for path, line in key_lines(node).items() if line == exc.line]
            if not keys:
                raise
            dotted = ".".join(str(part) for part in max(keys, key=len))
            raise SpecError(f"{dotted}: {exc.message}", line=exc.line) from None
    except SpecError:
        raise
    except yaml.YAMLError as exc:
        mark, context = getattr(exc, "problem_mark", None), getattr(exc, "context_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if context is not None and getattr(exc, "context", None):
            problem += f" ({exc.context} that starts at line {context.line + 1})"
        line = mark.line + 1 if mark else None
        if line is None and isinstance(exc, yaml.reader.ReaderError):
            line = text[: exc.position].count("\n") + 1
        raise SpecError(f"not valid YAML: {problem}", line=line) from None
    except (RecursionError, MemoryError, ValueError, TypeError, OverflowError) as exc:
        raise SpecError(f"cannot read as YAML ({type(exc).__name__}: {shown(str(exc))})") from None


def key_lines(node: yaml.Node | None, prefix: tuple = ()) -> dict[tuple, int]:
    """Maps each dotted key path (as a tuple) to its 1-based line in the YAML source (bounded: the node tree
    passed _check_expansion)."""
    lines: dict[tuple, int] = {}
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                continue
            if key_node.tag == "tag:yaml.org,2002:merge":
                merged = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
                for source in merged:
                    for path, line in key_lines(source, prefix).items():
                        lines.setdefault(path, line)
                continue
            path = prefix + (key_node.value,)
            lines[path] = _line(key_node)
            lines.update(key_lines(value_node, path))
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            path = prefix + (index,)
            lines[path] = _line(item)
            lines.update(key_lines(item, path))
    return lines
