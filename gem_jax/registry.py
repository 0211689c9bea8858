"""Classes registered by the type of the config dataclass that selects them (data sources, tasks).

  SOURCES = Registry("data source")
  @SOURCES.register(MyDataConfig)        # a class with a `name`
  class MySource: ...
  SOURCES.lookup(cfg.data)               # -> MySource; an unregistered config type is a clear error
"""

from __future__ import annotations


class Registry:
  def __init__(self, what: str):
    self.what = what
    self._by_type: dict[type, type] = {}

  def register(self, config_type: type):
    """Class decorator: the class for configs of `config_type`."""
    def deco(cls):
      self._by_type[config_type] = cls
      return cls
    return deco

  def names(self) -> tuple[str, ...]:
    return tuple(sorted(cls.name for cls in self._by_type.values()))

  def lookup(self, config) -> type:
    cls = self._by_type.get(type(config))
    if cls is None:
      raise ValueError(f"no {self.what} is registered for config {type(config).__name__}; registered: "
                       f"{sorted(t.__name__ for t in self._by_type)}")
    return cls
