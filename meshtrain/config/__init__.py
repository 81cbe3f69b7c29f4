"""Every setting's one typed definition, and how the layers of a run's settings combine.

* :mod:`~meshtrain.config.settings`: :class:`TrainConfig`, every training setting with its
  default, limits, help and command-line flag.
* :mod:`~meshtrain.config.spec`: :class:`RunSpec` (a run as the CLI and profiles describe
  it: the task, the strategy and every training setting) and the settings file a launched
  rank receives.
* :mod:`~meshtrain.config.launching`: :class:`LaunchSettings`, the launcher's own options;
  :mod:`~meshtrain.config.hosts` and :mod:`~meshtrain.config.plan`, the options of the
  ``hosts`` commands and of ``plan``.
* :mod:`~meshtrain.config.environment`: what a process reads from its environment (am I
  a launched rank?).
* :mod:`~meshtrain.config.profiles`, :mod:`~meshtrain.config.layers` (``--set``, how layers
  combine), :mod:`~meshtrain.config.strategy_options` (a strategy from its name and
  options), :mod:`~meshtrain.config.resume` (what a resumed run may change).
"""
