"""Moved to :mod:`linattn.train.lora` (peft LoRA adapters on the attention projections); the names are
re-exported here so that code written against ``linattn.evaluate.lora`` keeps working."""

from __future__ import annotations

from ..train.lora import DEFAULT_TARGETS, LoRA, add_lora, load_lora

__all__ = ["DEFAULT_TARGETS", "LoRA", "add_lora", "load_lora"]
