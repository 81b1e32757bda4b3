"""Drafting: the `Drafter` interface, draft blocks, and the drafters themselves."""

from specd_core.draft import DraftBlock, DraftDist, Drafter

from .prompt_lookup import PromptLookupSpeculator

__all__ = ["DraftBlock", "DraftDist", "Drafter", "PromptLookupSpeculator"]
