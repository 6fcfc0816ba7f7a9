"""`search`: Context-1's self-editing search environment (issue 13).

Modules: `reward` (the exact reward, pure functions), `quotes` (the quote-matching normalisation
cascade), `generator` (seeded corpus and tasks, extraction-based verification, hop curriculum).
"""
