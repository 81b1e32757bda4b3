"""Prompts written for this project to self-distil the target (`specd train-drafter`).

Deterministic: a fixed list of templates crossed with a fixed list of subjects, plus a few
hand-written coding and writing requests. None of them is a benchmark prompt.
"""

from __future__ import annotations

TEMPLATES = (
    "Explain {s} in simple terms.",
    "What are the most important facts about {s}? Give a detailed answer.",
    "What are the advantages and disadvantages of {s}?",
    "Write a short paragraph for a curious teenager about {s}.",
    "How has {s} changed over the last hundred years?",
    "What are common misconceptions about {s}?",
    "Give me five tips for someone who wants to learn about {s}.",
    "Compare {s} with something similar and explain the differences.",
)

SUBJECTS = (
    "photosynthesis", "volcanoes", "the water cycle", "black holes", "vaccines",
    "the immune system", "climate change", "renewable energy", "electric cars",
    "the printing press", "the Roman Empire", "the French Revolution", "ancient Egypt",
    "the industrial revolution", "the internet", "machine learning", "computer memory",
    "compilers", "databases", "encryption", "sleep", "healthy eating", "running a marathon",
    "learning a new language", "playing the piano", "gardening", "bread baking", "coffee",
    "tea", "chess", "the stock market", "inflation", "saving money", "public speaking",
    "time management", "friendship", "the ocean tides", "earthquakes", "rainbows",
    "the moon", "Mars", "the solar system", "dinosaurs", "evolution", "DNA", "antibiotics",
    "the human heart", "the brain", "music theory", "impressionist painting", "poetry",
    "libraries", "city planning", "bicycles", "trains", "airplanes", "rivers", "forests",
    "deserts", "recycling", "honey", "wolves", "cats", "dogs", "owls", "coral reefs",
    "mathematics", "prime numbers", "probability", "the Pythagorean theorem", "gravity",
    "electricity", "magnets", "light", "sound", "weather forecasts", "mountains",
)

EXTRA = (
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "How do I read a CSV file in Python? Show an example.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "What is recursion? Show a small example in Python.",
    "How do I sort a list of dictionaries by a key in Python?",
    "Explain what a hash table is and why lookups are fast.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a polite email asking a colleague to review a document by Friday.",
    "Summarize the plot of a typical hero's journey story.",
    "Plan a three-day trip to a city with museums and parks.",
    "What should I pack for a weekend camping trip?",
    "Give me a simple recipe for vegetable soup.",
    "How can I improve my concentration while studying?",
    "Describe a sunrise over the sea in a few vivid sentences.",
)


def prompts() -> list[str]:
    """All training prompts in a fixed order: every template for each subject in turn, then
    the hand-written ones (so the last subjects, held out by `specd train-drafter`, are never
    trained on in any template)."""
    return [t.format(s=s) for s in SUBJECTS for t in TEMPLATES] + list(EXTRA)
