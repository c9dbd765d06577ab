"""The HTTP read API: features, batches and predictions, per tenant, as JSON.

Routes, contract and errors: :mod:`freshline.pipeline.api.openapi` (served at ``/openapi.json``).
"""

from freshline.pipeline.api.app import app_from_env, create_app

__all__ = ["app_from_env", "create_app"]
