"""The Kafka side of freshline: decode, route, batch, recompute, commit."""
