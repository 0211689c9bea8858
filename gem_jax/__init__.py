"""gem-jax: GEM-style ads recommendation foundation models in JAX (README.md, ../shared/DESIGN.md)."""

from gem_jax import gc_env as _gc_env, malloc_env as _malloc_env, xla_env as _xla_env

# Before anything imports jax's backends: XLA reads its flags once, when they start (gem_jax/xla_env.py).
XLA_ENV = _xla_env.apply()
CPU_WITHOUT_DRIVER = _xla_env.cpu_without_driver()
# Opt-in collector thresholds for a process that mostly traces and compiles (gem_jax/gc_env.py).
GC_THRESHOLDS = _gc_env.apply()
# Freed heap memory stays for the next step instead of faulting back in page by page (gem_jax/malloc_env.py).
# It imports jax (to set its CPU dispatch), so it comes after everything above that sets what jax reads then.
MALLOC_ENV = _malloc_env.apply()
