# SPDX-License-Identifier: Apache-2.0
"""The test command's suite runners; ``forktools/run_tests.py`` is the entry point."""
