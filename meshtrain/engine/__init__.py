"""The training engine: the Trainer API, the node loop, the job it runs and the runtimes.

* :mod:`~meshtrain.engine.trainer`: :class:`Trainer`, the API (``fit``).
* :mod:`~meshtrain.engine.job`: what one run is (:class:`NodeJob`) and what it returns.
* :mod:`~meshtrain.engine.loop`: one node's training loop.
* :mod:`~meshtrain.engine.runtimes`: where the nodes run (threads, processes, launched ranks).
* :mod:`~meshtrain.engine.loggers`: metrics loggers (CSV, TensorBoard, W&B).
"""
