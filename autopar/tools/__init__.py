"""Tools that measure the layers below them by running them: ``calibrate`` (links and compute of a
live process group), ``profiler`` (one op on this machine's device), ``validate`` and its
``simulate`` (every sharding rule against the dense op, through the real generated code),
``measure`` (a step's time and peak memory), ``overlap`` (how much communication hides behind
compute). Nothing below the API imports them (tests/test_layering.py)."""
