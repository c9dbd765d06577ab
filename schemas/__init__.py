"""Event contracts (JSON Schema) and the feature-definition lock."""
