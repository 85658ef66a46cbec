"""Plans of a config on a mesh, above everything else in ``sat_jax`` (docs/DESIGN.md §1, §9.1).

- ``memory``: per-device parameter, gradient and optimizer bytes from shapes alone, and the reports
  of a compiled train step or server (``report_train``, ``report_serve``).
- ``programs``: the train step and the serving programs, lowered and compiled without allocating.
- ``topology``: compile-only devices of a TPU slice from libtpu, the chips' figures, HBM accounting.
- ``hlo_flops``: the matmul FLOPs of a compiled program's HLO.
- ``quantized``: the server's per-device memory and decode roofline for each
  ``server.weight_dtype`` × ``server.kv_cache_dtype`` (``--serve``'s table).
- ``lengths``: a distribution of trajectory lengths (a file or a named one) as padded and packed
  batches: padded fraction, FLOPs per useful token (``--lengths``).

``python -m sat_jax.plan`` (``__main__``) is the command line; it alone reads flags and the
environment. The package imports none of its modules.
"""
