"""The training engine: the Trainer API, the node loop, the job it runs and the runtimes.

* :mod:`~meshtrain.engine.trainer`: :class:`Trainer`, the API (``fit``).
* :mod:`~meshtrain.engine.job`: what one run is (:class:`NodeJob`) and what it returns.
* :mod:`~meshtrain.engine.loop`: one node's training loop, its step whole in ``train_node``.
* :mod:`~meshtrain.engine.callbacks`: what a step does besides training, one job per class
  (faults, sync checks, non-finite guard, validation, checkpoints, progress, status), and
  the clock that measures a node's compute.
* :mod:`~meshtrain.engine.report`: rank 0's history, summary, projection and run directory.
* :mod:`~meshtrain.engine.runtimes`: where the nodes run (threads, processes, launched ranks),
  a registry of name -> runner.
* :mod:`~meshtrain.engine.loggers`: metrics loggers (CSV, TensorBoard, W&B).
"""

from meshtrain.engine.math_kernels import resolve_math_kernels

# Before this process's first exp or tanh on several threads, which oneMKL 2024.2 can get
# wrong on one thread's chunk (engine/math_kernels.py). Here, not in ``import meshtrain``
# (which stays free of torch for the commands that never compute): the Trainer, the node
# loop and every runtime, a launched rank's included, live in this package, so models
# built after ``from meshtrain import Trainer``, and every node, compute with the right kernels.
resolve_math_kernels()
