"""The fraud example's own code: what a team keeps beside its definitions.

``seed`` (synthetic data), ``simulator`` (changes and
their domain events), ``training`` (the example model), ``demo`` (the demo's HTTP
side) and ``cli`` (``freshline fraud ...``).
"""

from functools import cache
from pathlib import Path

import freshline


@cache
def own_repository() -> freshline.Repository:
    """This repository (the directory above this package), loaded once."""
    return freshline.load(Path(__file__).resolve().parents[1])


def own_store() -> freshline.FeatureStore:
    """A store of this repository with the environment's settings; it connects to
    nothing until asked (the seed and the trainer hand it their own engine)."""
    return freshline.FeatureStore(own_repository())
