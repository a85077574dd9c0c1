"""The applications: programs built on the layers below, which nothing in the package imports.

* :mod:`~cbpause.apps.scenarios` (``python -m cbpause.apps.scenarios``, ``nox -s traces``): recorded scenarios on
  simulated ranks or transformers' real loop, each trace validated by TLC;
* :mod:`~cbpause.apps.bench` (``python -m cbpause.apps.bench``): cbpause against upstream;
* :mod:`~cbpause.apps.soak` (``nox -s soak``) and :mod:`~cbpause.apps.hostile` (``nox -s hostile``);
* :mod:`~cbpause.apps.demo` and :mod:`~cbpause.apps.demo.rl` (``python -m cbpause.apps.demo [--rl]``);
* :mod:`~cbpause.apps.diagrams`: the documentation site's pictures, drawn from TLC's output.
"""
