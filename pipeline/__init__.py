"""freshline: fresh, versioned ML features in Redis, driven by change events."""

__version__ = "0.1.0"
