"""Trace replay against live OpenAI-compatible endpoints (``smetric replay``)."""
