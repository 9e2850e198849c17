"""The source snapshots the conformance tests in this folder encode (repository@commit)."""

VAGEN = "RAGEN-AI/VAGEN@d2b8b30b4db41073e2b3ecad269f9c1c52522362"
"""VAGEN as its paper ran it (2025-10-01)."""
SKYRL = "NovaSky-AI/SkyRL@a9564572eb8e91076be43c1bd5e4615e3de17265"
"""SkyRL with its VisGym recipe, examples/train/visgym/ (2026-08-21)."""
VISGYM = "visgym/VisGym@0289034b0cefa6fbbad27f7dd8c01545df324afd"
"""VisGym's environments, gymnasium/envs/ (2026-03-10)."""
