"""The core: the protocol, standard library only (``tests/test_house.py`` keeps it so).

* :mod:`~cbpause.core.transitions` and :mod:`~cbpause.core.group`: the protocol's state changes as pure
  functions, one per TLA+ action, for one rank and for the whole group;
* :mod:`~cbpause.core.protocol` and :mod:`~cbpause.core.loop`: ``RankProtocol``, one rank's side, thread-safe
  (the explicit holder and loop APIs); :mod:`~cbpause.core.dropin`: ``PauseProtocol``, the same with
  transformers' drop-in API;
* :mod:`~cbpause.core.errors`, :mod:`~cbpause.core.arguments` (the checks of a mode and a timeout),
  :mod:`~cbpause.core.metrics`, :mod:`~cbpause.core.condition` (the lock and waits a Ctrl-C cannot break) and
  :mod:`~cbpause.core.recorder` (opt-in trace recording).

The public names are re-exported by :mod:`cbpause`.
"""
