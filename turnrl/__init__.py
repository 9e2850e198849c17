"""turnrl: multi-turn reinforcement learning for language and vision-language agents."""

__version__ = "0.1.0"
