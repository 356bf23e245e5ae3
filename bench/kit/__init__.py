"""Helpers shared by the bench scripts and the tests: hostile-frame generators, the LMCache venv
and its reference driver, index-content comparison, the peer indexers' harness.

Bench scripts import it as ``kit`` (their folder is on ``sys.path`` when run as
``python bench/x.py``); tests through pytest's ``pythonpath``. It imports nothing from tests/.
"""
