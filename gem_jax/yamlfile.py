"""YAML files read strictly: a key given twice in one mapping is an error naming both lines, where PyYAML's
safe_load keeps the last one and drops the first without a word (a spec listing `user_id:` twice would lose
one of them)."""

from __future__ import annotations

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
  pass


def _mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
  first_line = {}
  for key_node, _ in node.value:
    key = loader.construct_object(key_node, deep=True)
    try:
      seen = key in first_line
    except TypeError:   # an unhashable key: SafeLoader's own error says so below
      continue
    if seen:   # on another line, or twice in one flow mapping ({a: 1, a: 2})
      raise yaml.constructor.ConstructorError(
          "while reading a mapping", node.start_mark,
          f"found key {key!r} a second time (first given at line {first_line[key] + 1})", key_node.start_mark)
    first_line[key] = key_node.start_mark.line
  return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def load(stream):
  """yaml.safe_load that refuses duplicate keys (yaml.YAMLError, with the line of each)."""
  return yaml.load(stream, Loader=_UniqueKeyLoader)
