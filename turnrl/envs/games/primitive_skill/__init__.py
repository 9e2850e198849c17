"""PrimitiveSkill on MuJoCo: the env (:mod:`.env`) and its simulated scene and controller (:mod:`.sim`)."""

from turnrl.envs.games.primitive_skill.primitive_skill_env import PrimitiveSkillEnv

__all__ = ["PrimitiveSkillEnv"]
