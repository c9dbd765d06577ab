"""The fraud example's own code: what a team keeps beside its definitions.

``seed`` (synthetic data), ``simulator`` (changes and
their domain events), ``training`` (the example model), ``demo`` (the demo's HTTP
side) and ``cli`` (``freshline fraud ...``).
"""
