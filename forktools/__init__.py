# SPDX-License-Identifier: Apache-2.0
"""The project's tooling around the vLLM NIXL series, as one package.

``tools/setup_env.sh`` installs it into ``.venv`` (a ``.pth`` naming the
repository), so every process, whichever vLLM tree leads its
``PYTHONPATH``, imports it as ``forktools`` without changing ``sys.path``.
The name is not ``tools``: vLLM ships a ``tools`` package of its own.

By role:

- shared: ``paths`` (the repository's paths), ``tables`` (numbers and
  Markdown tables), ``pages`` (the project's pages as text);
- the series: ``fork`` (build, save, export), ``manifest``, ``release``
  (take a new vLLM release), ``covers`` (PR descriptions);
- the environment: ``cpu_ext`` (vLLM's CPU extension), ``run_costs``;
- the test command: ``run_tests`` and ``testrun``;
- ``harness``: planner-built layouts and real NIXL agents, shared by
  ``checks/`` and ``bench``;
- ``bench``: the main job and the block-pool benchmarks;
- ``docs_tables``: the pages' tables, rendered from measured JSON.
"""
