"""Every setting's one typed definition, and how the layers of a run's settings combine.

* :mod:`~meshtrain.config.settings`: :class:`TrainConfig`, every training setting with its
  default, help and rule.
* :mod:`~meshtrain.config.spec`: :class:`RunSpec` (a run as the CLI and profiles describe
  it), profiles, ``--set``, resolving the layers, and building the strategy.
"""
