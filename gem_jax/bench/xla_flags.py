"""Named XLA:CPU flag sets that the benchmarks compare (experiments/compile_flags.py, experiments/bench_hstu_stack.py
--flag-sets): each runs in a fresh process with the set as its XLA_FLAGS, since XLA reads them once per process.

COMPILE: what makes programs cheaper to compile (the test suite uses the cheapest; tests/conftest.py).
RUNTIME: jaxlib 0.10.2's options for faster programs: dots and elementwise fusions handed to XNNPACK, YNNPACK
or oneDNN, fast math, the vector width, the scheduler. Measured 2026-12-05 on the HSTU stacks and the main job
(README, "XLA:CPU options"): none moved a step by more than the noise, so none is set by default.
"""

COMPILE = {
    "default": "",
    "O0": "--xla_backend_optimization_level=0",
    "O0_no_fusion_emitters": "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
}
RUNTIME = {
    "xnnpack": "--xla_cpu_use_xnnpack=true",
    "xnn_dot": "--xla_cpu_experimental_xnn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "xnn_greedy": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "ynn_dot": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "ynn_dot_eltwise": "--xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,"
                       "LIBRARY_FUSION_TYPE_ELTWISE",
    "onednn": "--xla_cpu_use_onednn=true",
    "fast_math": "--xla_cpu_enable_fast_math=true",
    "vec256": "--xla_cpu_prefer_vector_width=256",
    "concurrency_sched": "--xla_cpu_enable_concurrency_optimized_scheduler=true",
}
ALL = {**COMPILE, **RUNTIME}
