# SPDX-License-Identifier: Apache-2.0
"""The project's tooling around the vLLM NIXL series, as one package.

``tools/setup_env.sh`` installs it into ``.venv`` (a ``.pth`` naming the
repository), so every process imports it whichever vLLM tree leads its
``PYTHONPATH``. The name is not ``tools``: vLLM ships a ``tools`` package of
its own. project-docs/fork.md ("Layout") lists the modules by role.
"""
