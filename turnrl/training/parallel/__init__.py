"""Parallel strategies: how the trainer's models are spread over processes (:class:`~.strategy.ParallelStrategy`)."""
