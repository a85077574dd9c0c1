"""Trace scenarios: runs of ``PauseProtocol`` recorded and validated against the TLA+ spec by TLC.

``python -m cbpause.apps.scenarios`` (``nox -s traces``) runs random threaded scenarios of simulated ranks in one
process (:mod:`~cbpause.apps.scenarios.group`); with ``--real``, scenarios on transformers' real loop, single-rank
and TP=2 over gloo (:mod:`~cbpause.apps.scenarios.real`, :mod:`~cbpause.apps.scenarios.episodes`,
:mod:`~cbpause.apps.scenarios.tp`), with the coverage of the spec's transitions
(:mod:`~cbpause.apps.scenarios.coverage`).
An application: it uses the integration, the testing kit and :mod:`cbpause.tlc`.
"""
