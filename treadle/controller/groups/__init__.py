"""Single controller, SPMD workers: resource pools, worker groups and dispatch.

The driver owns the dataflow and calls methods on a worker group as if it were one object; how
a call's arguments are spread over the ranks and how the ranks' results are gathered is
declared once, on the worker method, so the driver never handles ranks.

- :mod:`.dispatch`: :func:`register` and what it declares (:class:`Dispatch`,
  :class:`Collect`, the batch fields a method reads and returns), and the pure functions that
  spread a call's arguments and gather its results.
- :mod:`.failures`: a dead rank or replica in words (:func:`death_cause`, :func:`pid_note`),
  and :func:`ray_get`, which re-raises a worker's user-fixable error as itself.
- :mod:`.worker`: :class:`Worker`, the base of every SPMD worker (joins its process group),
  the rendezvous (:func:`free_port`, :func:`tcp_store`) and :func:`guarded`.
- :mod:`.pool`: :class:`ResourcePool`, a Ray placement group with one bundle per rank.
- :mod:`.group`: :class:`WorkerGroup`, N ranks of one worker class called as one object, on
  Ray or in the driver's process (``backend="local"``).

Each module imports only ones listed above it (``group`` all four); :mod:`treadle.controller`
hands their names on.
"""
