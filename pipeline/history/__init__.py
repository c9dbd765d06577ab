"""History: every version of every captured row, recorded from the change stream, and
the snapshot each entry was computed from (``docs/training.md``)."""
