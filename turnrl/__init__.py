"""turnrl: multi-turn reinforcement learning for language and vision-language agents.

Importing turnrl registers the built-in envs with Gymnasium (``turnrl/<Name>-v0``),
as ``import ale_py`` does for Atari, so that ``gymnasium.make("turnrl/Sokoban-v0")``
works after it. Registration uses entry-point strings: no env module is imported.
"""

from turnrl.envs.catalog import register_all as _register_all

__version__ = "0.1.0"

_register_all()
