"""Shared fixtures: small KV layouts and fake installed distributions."""

from __future__ import annotations

from support import caches, fake_dist, layout

__all__ = ["caches", "fake_dist", "layout"]
