"""The fault-injection suite (issue 13): real faults on a private stack, then an oracle.

Run it with ``pytest -m faults`` (the ``short`` profile) or
``FRESHLINE_CHAOS_PROFILE=long pytest tests/faults``; ``freshline chaos`` runs it and
writes ``bench/CHAOS.md``. See the README, "Fault injection".
"""
