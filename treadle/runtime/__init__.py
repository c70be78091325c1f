"""The process's plumbing, below every other layer: what any module of treadle may use.

- :mod:`.errors`: the exceptions a user can act on (``ConfigError``, ``DataError``, ...);
- :mod:`.plugins`: user code named in a config (``path/to/file.py:name``, ``module:name``);
- :mod:`.omp`, :mod:`.memory`: threads and the heap of a training process;
- :mod:`.reaper`: nothing a run started outlives it; :mod:`.faults`: fault injection for tests;
- :mod:`.startup`: where the time to the first step goes;
- :mod:`.cache`, :mod:`.importcache`: answers worked out once and kept on disk;
- :mod:`.moved`: the import paths of modules that moved, kept working.
"""
