"""The benchmarks, a package apart from the core: `python -m bench --help` lists them (__main__.py).

Modules by concern: common (fresh processes, resident memory, timing), engine (rollout, cache,
eval), judge (judge, judge-server), update (memory, update, scale, allocator), learn (learn, sweep,
pair and their paired statistics), fit3b (the 3B fit on a T4, the GPU check). The package imports
the core modules; no core module imports it.
"""
