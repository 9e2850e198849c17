"""Rollout backends: where and when a step's episodes are played (:class:`~.backend.RolloutBackend`)."""
