"""ferry.flow: durable sagas on trio (SPEC 5). Work in progress."""

from __future__ import annotations
