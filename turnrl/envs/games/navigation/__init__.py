"""Navigation on MiniWorld: the env (:mod:`.env`), its floor plans (:mod:`.layouts`) and the OpenGL side
(:mod:`.gl`)."""

from turnrl.envs.games.navigation.navigation_env import NavigationEnv

__all__ = ["NavigationEnv"]
