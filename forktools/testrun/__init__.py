# SPDX-License-Identifier: Apache-2.0
"""The test command's suite runners; ``forktools/run_tests.py`` is the entry point.

Modules: ``suites`` (the table), ``common`` (paths, git, env, a row),
``lint``, ``pytest_runs``, ``bisection``, ``project_checks``, ``mutations``
and ``report`` (the summary table and JSON).
"""
