"""`--spec FILE`: a job spec written in JSON or YAML, read into the same plain data, which
JobSpec then validates as it does any spec. YAML is read strictly: no anchors or aliases (a
few lines of them expand to gigabytes), no duplicate or non-string keys, only the kinds of
value JSON has, at most the spec's size limit; each refusal names its line and column."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from yaml._yaml import CParser
from yaml._yaml import Mark as CMark
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.nodes import MappingNode, Node
from yaml.resolver import Resolver

from campugrid.protocol.errors import InvalidInput
from campugrid.protocol.spec import MAX_SPEC_BYTES

_TAG = "tag:yaml.org,2002:"
_JSON_TAGS = frozenset(_TAG + t for t in ("str", "int", "float", "bool", "null", "seq", "map"))
# Where a node or an error is: libyaml's marks (text read by CParser), or PyYAML's.
_Mark = yaml.Mark | CMark
# Plain scalars that YAML 1.1 would turn into dates (or stranger things) stay strings.
_NOT_JSON = frozenset(_TAG + t for t in ("timestamp", "value", "yaml"))


class _Refused(Exception):
    def __init__(self, mark: _Mark | None, problem: str) -> None:
        super().__init__(problem)
        self.mark = mark
        self.problem = problem


class _StrictLoader(Composer, CParser, SafeConstructor, Resolver):
    """libyaml reads the text into events (PyYAML's own reader and scanner took 18 s for a
    spec at the size limit); PyYAML's composer, before CParser's, makes the nodes, so that
    every node passes compose_node below."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag not in _NOT_JSON]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        event = self.peek_event()
        if event is not None and (isinstance(event, yaml.AliasEvent)
                                  or getattr(event, "anchor", None) is not None):
            raise _Refused(event.start_mark, "anchors and aliases (&name, *name) are not "
                                             "allowed: write the value out each time")
        return super().compose_node(parent, index)

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        if node.tag not in _JSON_TAGS:
            raise _Refused(node.start_mark, f"a {node.tag.removeprefix(_TAG)} value is not "
                                            "allowed: only strings, numbers, true/false, null, "
                                            "lists and mappings (quote it to make it a string)")
        return super().construct_object(node, deep)

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[str, _Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == _TAG + "merge":
                raise _Refused(key_node.start_mark, "merge keys (<<) are not allowed: write "
                                                    "the keys out")
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, str):
                raise _Refused(key_node.start_mark, f"the key {key!r} is not a string: quote it")
            if key in seen:
                first = seen[key]
                raise _Refused(key_node.start_mark, f"the key {key!r} is given twice (first on "
                                                    f"line {first.line + 1}): keep one")
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)

    def __init__(self, text: str) -> None:
        CParser.__init__(self, text)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)


def _at(path: Path, mark: _Mark | None) -> str:
    return f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)


def _from_yaml(path: Path, text: str) -> dict[str, Any]:
    loader = _StrictLoader(text)
    try:
        node = loader.get_single_node()
        if not isinstance(node, MappingNode):
            raise _Refused(node.start_mark if node is not None else None,
                           "the spec must be a mapping of keys to values (command: ..., "
                           "resources: ...)")
        data = loader.construct_document(node)
    except _Refused as e:
        raise InvalidInput(f"{_at(path, e.mark)}: {e.problem}") from None
    except yaml.MarkedYAMLError as e:
        raise InvalidInput(f"{_at(path, e.problem_mark)}: not valid YAML ({e.problem})") from e
    except yaml.YAMLError as e:
        raise InvalidInput(f"{path}: not valid YAML ({e})") from e
    except RecursionError:
        raise InvalidInput(f"{path}: nested too deeply") from None
    finally:
        loader.dispose()
    assert isinstance(data, dict)
    return data


def _from_json(path: Path, text: str) -> dict[str, Any]:
    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        data: dict[str, Any] = {}
        for key, value in items:
            if key in data:
                raise InvalidInput(f"{path}: the key {key!r} is given twice: keep one")
            data[key] = value
        return data

    try:
        data = json.loads(text, object_pairs_hook=pairs)
    except json.JSONDecodeError as e:
        raise InvalidInput(f"{path}:{e.lineno}:{e.colno}: not valid JSON ({e.msg})") from e
    except RecursionError:
        raise InvalidInput(f"{path}: nested too deeply") from None
    if not isinstance(data, dict):
        raise InvalidInput(f"{path}: the spec must be a JSON object ({{\"command\": ...}})")
    return data


def load(path: Path) -> dict[str, Any]:
    """The spec in `path` as plain data: YAML for .yaml and .yml, JSON for .json, and
    otherwise JSON if it reads as JSON, else YAML."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as e:
        raise InvalidInput(f"cannot read the spec {path} ({e.strerror or e}): check the path "
                           "given to --spec") from e
    if len(raw) > MAX_SPEC_BYTES:
        raise InvalidInput(f"{path}: larger than {MAX_SPEC_BYTES // 1024**2} MiB, the most a "
                           "spec may be: split the job's shards over several jobs")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise InvalidInput(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); save it "
                           "as UTF-8") from e
    suffix = path.suffix.lower()
    if suffix in (".yaml", ".yml"):
        return _from_yaml(path, text)
    if suffix == ".json":
        return _from_json(path, text)
    try:
        return _from_json(path, text)
    except InvalidInput:
        return _from_yaml(path, text)


# A folder's own spec, picked up by `submit` when no --spec is given.
SPEC_NAMES = ("campugrid.yaml", "campugrid.yml", "job.yaml", "job.yml", "job.json")


def given(**given: Any) -> dict[str, Any]:
    """The options given on the command line (None: not given)."""
    return {k: v for k, v in given.items() if v is not None}


def megabytes(text: str, flag: str) -> int:
    """'4096' (MB), '512M', '4G' or '4GB' as MB."""
    t = text.strip().upper().removesuffix("B")
    scale = {"M": 1, "G": 1024, "T": 1024 * 1024}.get(t[-1:], 0)
    number = t[:-1] if scale else t
    try:
        value = float(number) * (scale or 1)
    except ValueError:
        raise InvalidInput(f"{flag} {text}: give MB, or a size such as 512M or 4G") from None
    return int(value)
