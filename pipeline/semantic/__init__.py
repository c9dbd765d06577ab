"""The semantic response cache for LLM pipelines: embeddings, the per-worker index,
the cache itself and threshold tuning. See :mod:`freshline.pipeline.semantic.cache`."""
