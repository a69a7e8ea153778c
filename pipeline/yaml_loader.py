"""Read a YAML config file defensively: a hostile or broken file is one ConfigError, never a hang or a traceback.

A config is a few hundred bytes of nested mappings, so everything far beyond that is refused before it costs
anything: files over MAX_YAML_BYTES (checked on the size, before reading), nesting deeper than MAX_DEPTH
(PyYAML's composer recurses once per level and would hit Python's recursion limit), and anchors/aliases that
expand to more than MAX_ALIAS_NODES values (a "billion laughs" file of a few hundred bytes; PyYAML shares the
aliased objects, but validation and error messages walk every copy). Duplicate keys are an error naming the key
and line (YAML says keys are unique; PyYAML silently keeps the last). Text must be UTF-8 (a UTF-8 BOM is fine).
Only plain data is built (yaml.SafeLoader: no ``!!python`` tags).
"""

from __future__ import annotations

import codecs
import stat
from pathlib import Path

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from .errors import ConfigError

MAX_YAML_BYTES = 1 << 20  # 1 MiB: thousands of times a real config, and parsed in about a second
MAX_DEPTH = 32  # a config nests 4 levels
MAX_ALIAS_NODES = 100_000  # values after expanding aliases; a config has about a hundred

_BOMS = [(codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"), (codecs.BOM_UTF16_LE, "UTF-16"),
         (codecs.BOM_UTF16_BE, "UTF-16")]  # UTF-32 LE starts with the UTF-16 LE BOM: test it first


class _LimitedLoader(yaml.SafeLoader):
    """SafeLoader that refuses deep nesting and duplicate keys while composing (before anything is built)."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels at line {mark.line + 1}; a config nests "
                               f"a few levels, flatten the file")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise _Refused(f"duplicate key {_short(key_node.value)!r} at line {key_node.start_mark.line + 1}; "
                               f"YAML keys must be unique, remove one of them")
            seen.add(key)
        return node


class _Refused(Exception):
    """A limit or rule of this loader, raised from inside PyYAML and turned into a ConfigError."""


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _expanded_size(root) -> int:
    """Values in the document once aliases are expanded; refuses aliases that contain themselves."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node) -> int:  # depth is bounded by MAX_DEPTH, so recursion is safe here
        if id(node) in sizes:
            return sizes[id(node)]
        if id(node) in open_nodes:
            raise _Refused(f"an alias at line {node.start_mark.line + 1} refers to itself (a recursive "
                           f"structure); a config is plain nested data, write the values out")
        open_nodes.add(id(node))
        total = 1
        if isinstance(node, SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, MappingNode):
            total += sum(size(key) + size(value) for key, value in node.value)
        open_nodes.discard(id(node))
        sizes[id(node)] = total
        if total > MAX_ALIAS_NODES:
            raise _Refused(f"expands to more than {MAX_ALIAS_NODES} values through anchors and aliases (line "
                           f"{node.start_mark.line + 1}); a config holds about a hundred, write it without "
                           f"nested aliases")
        return total

    size(root)
    return sizes[id(root)]


def read_config_text(path: Path) -> str:
    """The file's text after the file-type, size and encoding checks (messages start with the path)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found; pass a YAML file such as configs/tiny.yaml") from None
    except OSError as exc:  # a symlink loop, a path through a file, permissions
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc}); pass a YAML file such "
                          f"as configs/tiny.yaml") from None
    if stat.S_ISDIR(info.st_mode):
        raise ConfigError(f"config file {path} is a folder, not a file; pass the YAML file, such as "
                          f"configs/tiny.yaml")
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) \
            else "a device"
        raise ConfigError(f"config file {path} is not a regular file ({kind}); pass a YAML file such as "
                          f"configs/tiny.yaml")
    if info.st_size > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: {info.st_size} bytes is larger than {MAX_YAML_BYTES // 1024} KiB, the limit "
                          f"for a config file; a config is a few hundred bytes, check that this is the right file")
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_YAML_BYTES + 1)  # the file may have grown since stat()
    except OSError as exc:
        raise ConfigError(f"config file {path} cannot be read ({exc.strerror or exc}); check its "
                          f"permissions") from None
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_YAML_BYTES // 1024} KiB, the limit for a config file")
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise ConfigError(f"{path}: the file is {name} text; save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}: not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}); save the file "
                          f"as UTF-8") from None


def load_yaml_file(path: Path) -> object:
    """Parse the config file into plain data (dicts, lists, scalars); ConfigError for anything else."""
    text = read_config_text(path)
    loader = None
    try:
        loader = _LimitedLoader(text)  # the reader already refuses control characters here
        root = loader.get_single_node()
        if root is None:
            return None
        _expanded_size(root)
        return loader.construct_document(root)
    except _Refused as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{path}: malformed YAML{where}: {_short(problem, 200)}; fix the syntax") from None
    finally:
        if loader is not None:
            loader.dispose()

