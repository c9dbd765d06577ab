"""Benchmarks: figures for every claim, each next to a reference measured in the same run.

Run ``python -m bench`` (see :mod:`bench.__main__`); results land in ``bench/RESULTS.md``.
"""
