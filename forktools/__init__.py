# SPDX-License-Identifier: Apache-2.0
"""The project's tooling around the vLLM NIXL series, as one package.

``tools/setup_env.sh`` installs it into ``.venv`` (a ``.pth`` naming the
repository), so every process, whichever vLLM tree leads its
``PYTHONPATH``, imports it as ``forktools`` without changing ``sys.path``.
The name is not ``tools``: vLLM ships a ``tools`` package of its own.

Subpackages by role: the modules at the top build, save and export the
series (``fork``, ``manifest``, ``release``) and set up the environment
(``cpu_ext``, ``run_costs``); ``testrun`` runs the test command;
``harness`` builds planner layouts and drives real NIXL for ``checks/``
and ``bench``; ``bench`` is the main job; ``docs_tables`` renders the
pages' tables from measured JSON.
"""
