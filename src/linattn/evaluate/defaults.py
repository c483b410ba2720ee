"""Defaults the measuring tools and the product share (the product reads them without importing the CLI's option
builders, which re-export its own)."""

from __future__ import annotations

LM_WINDOW, LM_SINKS = 64, 4  # the causal-LM window rows' defaults: StreamingLLM's 4 sinks, LoLCATs' 64-token window
