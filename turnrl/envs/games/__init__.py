"""The built-in envs, one home each: a module (``bandit``, ``frozenlake``, ``maze``, ``sudoku``, ``game2048``,
``rubiks``) or, for an env with helper modules of its own, a package (``countdown``, ``navigation``,
``primitive_skill``, ``sokoban``, ``spatial``, ``svg``).

Each is registered by name in :data:`turnrl.envs.catalog.BUILTIN_ENVS`; nothing here is imported until an env
is made. What other layers need to know about an env (its state-reward profile, the settings the built-in
tokenizer's corpus plays) is a class attribute of the env (:class:`turnrl.envs.contract.TurnEnv`).
"""
