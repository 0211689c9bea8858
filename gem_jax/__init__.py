"""gem-jax: GEM-style ads recommendation foundation models in JAX (README.md, ../shared/DESIGN.md)."""

from gem_jax import xla_env as _xla_env

# Before anything imports jax's backends: XLA reads its flags once, when they start (gem_jax/xla_env.py).
XLA_ENV = _xla_env.apply()
CPU_WITHOUT_DRIVER = _xla_env.cpu_without_driver()
