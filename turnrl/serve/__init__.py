"""Serving over HTTP: an OpenAI-compatible server for transformers policies (envs are served by
:mod:`turnrl.envservice`)."""
