"""Block sizes of the HSTU attention Pallas kernel (a frozen config; no logic lives here).

block_q: query tokens per program; block_k: key tokens per inner-loop step. Both must be powers of two
(Triton tiles are) and at least 16 on GPU (tensor-core dot tiles); interpret mode takes any power of two.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class HSTUBlockConfig:
  block_q: int = 64
  block_k: int = 64

  def __post_init__(self):
    for name in ("block_q", "block_k"):
      size = getattr(self, name)
      if size < 1 or size & (size - 1):
        raise ValueError(f"HSTUBlockConfig.{name} must be a power of two >= 1, got {size}")


GPU_BLOCKS = HSTUBlockConfig(block_q=64, block_k=64)
# Small tiles so that CPU tests with rows of ~40 tokens cross several block boundaries.
CPU_TEST_BLOCKS = HSTUBlockConfig(block_q=8, block_k=8)
