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
