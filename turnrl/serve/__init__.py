"""Serving over HTTP: an OpenAI-compatible server for transformers policies (and, next, envs)."""
