"""Safe reading of the YAML files people write: workflow specs and `kvflow-ray serve --config` files.

Two hazards beyond what ``yaml.safe_load`` already prevents (arbitrary objects):

* **Aliases** (``*name``, and the anchors ``&name`` they refer to). A few lines of nested aliases
  (a "billion laughs" document) expand to billions of nodes: ``yaml.safe_load`` spins for minutes
  or exhausts memory. Nothing we read needs them, so :class:`SafeYamlLoader` refuses both as soon as
  it meets one.
* **Size**. :func:`read_text_file` reads at most ``max_bytes`` (+1 to notice more) and decodes UTF-8,
  so a huge file (or ``/dev/zero``) cannot fill memory.

It also refuses duplicate mapping keys: PyYAML silently keeps the last one, which would quietly drop
an agent (or a setting) defined twice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "MAX_CONFIG_FILE_BYTES",
    "SafeYamlLoader",
    "TextFileError",
    "decode_utf8",
    "describe_yaml_error",
    "load_yaml",
    "read_text_file",
]

# Specs and configs are a few KiB; 4 MiB leaves room for long inline prompts.
MAX_CONFIG_FILE_BYTES = 4 * 1024 * 1024

ALIAS_MESSAGE = "YAML aliases (*name) are not supported"
ANCHOR_MESSAGE = "YAML aliases (*name) are not supported, nor are anchors (&name): write the value out in full"


class SafeYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` (plain data only) that also refuses anchors/aliases and duplicate keys.

    The check runs while composing, before an alias is expanded, so an alias bomb fails at once.
    """

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, f"{ALIAS_MESSAGE} (found *{event.anchor})", event.start_mark
            )
        anchor = getattr(event, "anchor", None)
        if anchor is not None:
            raise yaml.composer.ComposerError(None, None, f"{ANCHOR_MESSAGE} (found &{anchor})", event.start_mark)
        return super().compose_node(parent, index)  # type: ignore[no-any-return]


def _construct_mapping(loader: SafeYamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # unhashable key: let the default constructor report it
            break
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


SafeYamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml(text: str) -> Any:
    """Parse one YAML document with :class:`SafeYamlLoader`. Raises ``yaml.YAMLError`` (also for a
    document nested too deeply to parse, which PyYAML would report as a RecursionError)."""
    try:
        return yaml.load(text, Loader=SafeYamlLoader)  # a SafeLoader subclass: plain data only
    except RecursionError:
        raise yaml.YAMLError("document nested too deeply") from None


def describe_yaml_error(exc: yaml.YAMLError) -> str:
    """One line for a YAML error: the problem and where (PyYAML's own text spans several lines and
    quotes the source)."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        mark = exc.problem_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        context = f"{exc.context}: " if exc.context else ""
        return f"{context}{exc.problem}{where}"
    return " ".join(str(exc).split())


class TextFileError(ValueError):
    """A file that was read but is not acceptable: too large, or not UTF-8 text."""


def read_text_file(path: str | Path, max_bytes: int = MAX_CONFIG_FILE_BYTES) -> str:
    """The UTF-8 text of ``path``, refusing more than ``max_bytes`` bytes.

    Raises ``OSError`` when the file cannot be opened or read, :class:`TextFileError` when it is too
    large or not UTF-8. The path is the operator's choice (a command-line argument), so pipes such as
    ``<(generate-spec)`` are allowed; only the amount read is bounded.
    """
    with open(path, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TextFileError(f"larger than the {max_bytes}-byte limit")
    return decode_utf8(data)


def decode_utf8(data: bytes) -> str:
    """``data`` as UTF-8 text; :class:`TextFileError` with the offset of the first bad byte if not."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TextFileError(f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start})") from None
